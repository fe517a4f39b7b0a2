"""Loading a Hugging Face checkpoint (a local folder or a hub id): config check, weights, tokenizer."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from criticalkv.models.device import DeviceMap, _resolve_dtype
from criticalkv.models.support import _check_config, check_supported

logger = logging.getLogger(__name__)


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


def load_checkpoint(
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
