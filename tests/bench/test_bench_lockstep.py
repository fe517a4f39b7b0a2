"""What ``benchmarks/``'s decode scripts share (criticalkv.bench.decode, criticalkv.bench.prompt): caches
stepped in lockstep decode exactly as the runtime's ``append_tokens`` does, the per-step metrics
against hand-computed values, the held caches, and the natural-text prompt."""

from __future__ import annotations

import math

import pytest
import torch

import criticalkv as ckv
from criticalkv.bench.decode import Lockstep, held_caches, prefill_logits, step_metrics
from criticalkv.bench.prompt import prompt_ids
from criticalkv.cache import CacheSpec
from criticalkv.runtime import append_tokens, prefill_into
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer


@torch.no_grad()
def test_lockstep_decodes_as_append_tokens_for_every_cache() -> None:
    model = ckv.attach(make_tiny("llama"))
    ids = torch.randint(3, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    spec = CacheSpec.of("snapkv", 16, 4, decode_budget=16, decode_interval=4)
    caches = held_caches(model, ["snapkv", "critical-adakv"], spec)
    references = held_caches(model, ["snapkv", "critical-adakv"], spec)
    assert list(caches) == ["full", "snapkv", "critical-adakv"]
    assert caches["full"].method.name == "full" and caches["snapkv"].decode is not None
    assert caches["critical-adakv"].spec == spec.replaced(method=caches["critical-adakv"].method)
    assert caches["full"].spec.window == 4 and caches["full"].spec.decode is None
    lockstep, masks = Lockstep.after(ids), {}
    token = {}
    for name in caches:
        first = prefill_logits(model, caches[name], ids)
        assert torch.equal(first, prefill_into(model, references[name], ids, torch.ones_like(ids)))
        token[name], masks[name] = first.argmax(-1, keepdim=True), torch.ones_like(ids)
    for _ in range(10):  # past the decode budget: re-selections happen in both
        lockstep.advance()
        for name in caches:
            mine = lockstep.step(model, caches[name], token[name])
            out, masks[name] = append_tokens(model, references[name], masks[name], token[name])
            assert torch.equal(mine, out.logits[:, -1])
            token[name] = mine.argmax(-1, keepdim=True)
    assert lockstep.mask.shape == (1, 50) and lockstep.position.tolist() == [[49]]
    assert caches["snapkv"].decode is not None and caches["snapkv"].decode.seconds > 0


def test_step_metrics_against_hand_computed_values() -> None:
    reference = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.25]]))
    metrics = step_metrics(reference, logits, token=0)
    assert metrics["nll"] == pytest.approx(math.log(4))
    assert metrics["top1"] is False
    assert metrics["kl"] == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5))
    assert step_metrics(reference, reference, token=0) == {"nll": pytest.approx(math.log(2)), "top1": True, "kl": 0.0}


def test_the_prompt_is_the_haystacks_first_tokens_and_refuses_more_than_it_has() -> None:
    tokenizer = char_tokenizer()
    short, longer = prompt_ids(tokenizer, 50), prompt_ids(tokenizer, 80)
    assert short.shape == (1, 50) and torch.equal(longer[:, :50], short)
    with pytest.raises(ValueError, match="the natural-text haystack has"):
        prompt_ids(tokenizer, 10**7)
