"""A character-level tokenizer built offline that fits the tiny test models' vocabulary (101)."""

from __future__ import annotations

import string

from tokenizers import AddedToken, Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<eos>", "<bos>"]  # ids 0, 1, 2 as in tests/conftest.py


def char_tokenizer() -> PreTrainedTokenizerFast:
    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {t: i for i, t in enumerate([*SPECIALS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    tok.padding_side = "left"
    return tok
