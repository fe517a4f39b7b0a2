"""Shared fixtures: tiny random Llama, Mistral and Qwen2 models (no download)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 101
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


def make_tiny(arch: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random causal LM of architecture ``arch`` (GQA: 6 query heads, 2 KV heads)."""
    torch.manual_seed(seed)
    model: PreTrainedModel
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON, head_dim=16))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**_COMMON, head_dim=16, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=False))
    else:
        raise ValueError(arch)
    return model.eval()


ARCHS = ["llama", "mistral", "qwen2"]


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    return make_tiny(request.param)


@pytest.fixture(scope="session")
def tiny_llama() -> PreTrainedModel:
    return make_tiny("llama")


def padded_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-padded ``input_ids`` and ``attention_mask`` with the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(3, VOCAB, (len(lengths), t), generator=g)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, t - n :] = 1
        ids[i, : t - n] = 0
    return ids, mask


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """Tiny tensors run faster without torch's thread pool (and do not fight a busy machine)."""
    from tests.random_state import one_thread

    with one_thread():
        yield
