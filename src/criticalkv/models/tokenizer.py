"""Repairing the SmolLM2 tokenizer that ``transformers`` reads from the default model's GGUF file."""

from __future__ import annotations

import json
import logging
from typing import Any

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from criticalkv.models.paths import default_model_dir

logger = logging.getLogger(__name__)

_IM_END = "<|im_end|>"
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


def _template_ids(post_processor: Any) -> set[int]:
    """Token ids a serialized post-processor inserts (TemplateProcessing, possibly in a Sequence)."""
    ids: set[int] = set()
    if isinstance(post_processor, dict):
        for special in (post_processor.get("special_tokens") or {}).values():
            ids.update(int(i) for i in special.get("ids", []))
        for inner in post_processor.get("processors") or []:
            ids |= _template_ids(inner)
    return ids


def _trim_model(model: dict[str, Any], vocab_size: int) -> None:
    """Drop the ids >= vocab_size (and the merges that need them) from a serialized tokenizer model."""
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


def _kept_specials(tokenizer: PreTrainedTokenizerBase, backend: Any, vocab_size: int) -> dict[str, str]:
    """The bos/eos/unk/pad tokens of ``tokenizer`` that ``backend`` still has within the vocabulary."""
    specials: dict[str, str] = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        token = getattr(tokenizer, attr, None)
        if token is not None:
            token_id = backend.token_to_id(str(token))
            if token_id is not None and token_id < vocab_size:
                specials[attr] = str(token)
    return specials


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
    _trim_model(data["model"], vocab_size)
    if any(i >= vocab_size for i in _template_ids(data.get("post_processor"))):
        logger.warning("dropping the tokenizer's post-processor: it inserts tokens beyond the vocabulary")
        data["post_processor"] = None
    new_backend = Tokenizer.from_str(json.dumps(data))
    rebuilt = PreTrainedTokenizerFast(
        tokenizer_object=new_backend,
        model_max_length=tokenizer.model_max_length,
        padding_side=tokenizer.padding_side,
        truncation_side=tokenizer.truncation_side,
        **_kept_specials(tokenizer, new_backend, vocab_size),
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


def repair_tokenizer(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> PreTrainedTokenizerBase:
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
