"""Fingerprints of a model and a tokenizer: what a saved cache is valid for.

A compressed cache holds keys and values that only the model that computed them can attend
over, for token ids that only the tokenizer that produced them can continue. A fingerprint is
a short hash of what determines both: the model's architecture, dtype and (a fixed sample of)
its weights; the tokenizer's vocabulary, special tokens and chat template.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

#: config fields that shape the cache or the attention over it
CONFIG_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_size",
    "head_dim",
    "vocab_size",
    "rope_theta",
    "max_position_embeddings",
)
#: elements read from each weight tensor (evenly strided): cheap, and any retrained or
#: re-initialised model differs in them
SAMPLES_PER_TENSOR = 64


def model_fingerprint(model: Any) -> dict[str, Any]:
    """``{"hash", "name", "dtype", "config"}`` identifying ``model`` for a saved cache.

    The hash covers :data:`CONFIG_FIELDS`, the parameters' names, shapes and dtypes, and
    :data:`SAMPLES_PER_TENSOR` strided elements of every parameter (float32 on the CPU).
    ``name`` (the checkpoint's path or hub id) is informative only: a moved checkpoint matches.
    """
    config = model.config.to_dict()
    fields = {key: config.get(key) for key in CONFIG_FIELDS}
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode())
    dtype = None
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            dtype = str(param.dtype) if dtype is None else dtype
            digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
            flat = param.detach().reshape(-1)
            step = max(1, flat.numel() // SAMPLES_PER_TENSOR)
            sample = flat[::step][:SAMPLES_PER_TENSOR].to(device="cpu", dtype=torch.float32).contiguous()
            digest.update(sample.numpy().tobytes())
    return {
        "hash": digest.hexdigest(),
        "name": str(config.get("_name_or_path") or config.get("name_or_path") or ""),
        "dtype": dtype,
        "config": fields,
    }


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """``{"hash", "name", "vocab_size"}`` identifying ``tokenizer`` for a saved cache.

    The hash covers the vocabulary (token -> id), the special tokens and the chat template.
    """
    vocab = tokenizer.get_vocab()
    specials = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "pad": tokenizer.pad_token_id,
        "template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None,
    }
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    digest.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return {"hash": digest.hexdigest(), "name": str(tokenizer.name_or_path or ""), "vocab_size": len(vocab)}
