"""The default model: SmolLM2-135M-Instruct, converted once from its GGUF file.

``transformers`` dequantises the GGUF file (see :mod:`criticalkv.models.gguf`), the tokenizer
is repaired (see :mod:`criticalkv.models.tokenizer`), and the result is saved once as a regular
safetensors checkpoint under :func:`~criticalkv.models.default_model_dir`, which later loads
read directly. The checkpoint is written into a staging folder of the cache and renamed into
place only once complete, with a source record (:data:`_SOURCE_FILE`) holding the size, time and
sha256 of every file it wrote, against which :mod:`criticalkv.models.converted` checks it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.models.gguf import _WHEEL_REQUIREMENT, _fetch_instructions, _gguf_cache_path, find_gguf
from criticalkv.models.integrity import _file_record
from criticalkv.models.paths import _DEFAULT_MODEL_NAME, ModelCacheError
from criticalkv.models.staging import _staging
from criticalkv.models.tokenizer import _IM_END_ID, repair_tokenizer

logger = logging.getLogger(__name__)

_SOURCE_FILE = "criticalkv-source.json"
_RECORD_FORMAT = 2  # 1 (no "files") was written before the files' sizes and checksums were recorded


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


def load_default_from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
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
        model, tokenizer = load_default_from_gguf(gguf)
    except Exception as error:
        raise ModelCacheError(
            f"could not read the default model's GGUF file {gguf}: {error}. If the file is damaged, delete "
            "it and load the default model again. " + _fetch_instructions(_gguf_cache_path())
        ) from error
    tokenizer = repair_tokenizer(tokenizer, _embedding_rows(model))
    _set_generation_tokens(model)
    return model, tokenizer


def _file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """The size, time and sha256 of every file in ``folder`` but the source record itself."""
    return {p.name: _file_record(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != _SOURCE_FILE}


def _source_record(gguf_name: str, digest: str, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The source record that marks a complete conversion: where it came from, what it wrote."""
    return {
        "model": _DEFAULT_MODEL_NAME,
        "gguf_file": gguf_name,
        "sha256": digest,
        "wheel": _WHEEL_REQUIREMENT,
        "format": _RECORD_FORMAT,
        "files": files,
    }


def _write_source(folder: Path, record: dict[str, Any]) -> None:
    """Write ``record`` as ``folder``'s source file, atomically (via a staging folder)."""
    with _staging("record") as scratch:
        partial = scratch / _SOURCE_FILE
        partial.write_text(json.dumps(record, indent=2) + "\n")
        os.chmod(partial, 0o644)
        os.replace(partial, folder / _SOURCE_FILE)


def _publish(folder: Path, target: Path) -> None:
    """Rename ``folder`` to ``target``, keeping another process's complete conversion if it won.

    The build lock keeps two processes from converting at once; this covers file systems where
    that lock does not hold (some network mounts).
    """
    try:
        os.rename(folder, target)
    except OSError:
        if not (target / _SOURCE_FILE).is_file():
            raise
        logger.info("another process converted the default model meanwhile; using %s", target)


def _convert_default_model(target: Path) -> None:
    """Read the known-good GGUF file and save the model as a safetensors checkpoint at ``target``.

    Everything is written in a staging folder of the cache, removed if anything fails; only a
    complete checkpoint with its source record is renamed to ``target``. The caller holds the
    build lock.
    """
    gguf, digest = find_gguf()
    started = time.perf_counter()
    logger.info("converting %s to a safetensors checkpoint (once)", gguf)
    model, tokenizer = _read_default_model(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _staging("convert") as scratch:
        folder = scratch / target.name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        gc.collect()
        _write_source(folder, _source_record(gguf.name, digest, _file_records(folder)))
        _publish(folder, target)
    logger.info("saved the default model to %s in %.1f s", target, time.perf_counter() - started)
