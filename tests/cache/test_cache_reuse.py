"""A CompressedCache holds one prompt: a new prompt is refused, every continuation is accepted.

Before the check, a cache reused with an unrelated prompt silently appended the new tokens to the
old compressed entries and answered differently from a fresh cache.
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.prompts import positions
from tests.conftest import make_tiny, padded_batch

WINDOW = 6
NEW = 6


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return ckv.attach(make_tiny("llama"))


def fresh(model: PreTrainedModel) -> ckv.CompressedCache:
    return ckv.CompressedCache.for_model(model, "critical-adakv", 0.3, window=WINDOW)


def generate(model: PreTrainedModel, cache: ckv.CompressedCache, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )
    return out


@pytest.mark.parametrize("length", [30, 52, 53, 80])  # shorter, as long as, one longer, longer than what is held
def test_generate_with_an_unrelated_prompt_on_a_used_cache_raises(model: PreTrainedModel, length: int) -> None:
    ids, mask = padded_batch([48, 37], seed=1)
    cache = fresh(model)
    generate(model, cache, ids, mask)
    held = cache.get_seq_length()
    assert held == 48 + NEW - 1
    other, other_mask = padded_batch([length, length - 3], seed=7)
    with pytest.raises(ValueError, match=r"already holds a compressed prompt of 53 tokens.*fork\(\)"):
        generate(model, cache, other, other_mask)
    assert cache.get_seq_length() == held  # nothing was appended


@pytest.mark.parametrize("length", [20, 80])
def test_an_unpadded_unrelated_prompt_is_refused_too(model: PreTrainedModel, length: int) -> None:
    """generate drops an all-ones mask: the prompt's own ids and length tell."""
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(12))
    cache = fresh(model)
    generate(model, cache, ids, torch.ones_like(ids))
    other = torch.randint(3, 100, (1, length), generator=torch.Generator().manual_seed(13))
    with pytest.raises(ValueError, match="already holds a compressed prompt of 45 tokens"):
        generate(model, cache, other, torch.ones_like(other))


def test_a_new_prefill_forward_into_a_used_cache_raises(model: PreTrainedModel) -> None:
    ids, mask = padded_batch([40, 40], seed=2)
    cache = fresh(model)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    with pytest.raises(ValueError, match=r"mask covers 40 tokens, where .* covers the 40 held plus the 40 new"):
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    with pytest.raises(ValueError, match="positions start at 0, not 40"):  # no mask: positions tell
        model(input_ids=ids, position_ids=positions(mask), cache=cache)


def test_generate_again_with_the_previous_output_continues(model: PreTrainedModel) -> None:
    """The output of generate, passed back in full, is a continuation: same tokens as one long run."""
    ids, mask = padded_batch([48, 37], seed=3)
    cache = fresh(model)
    first = generate(model, cache, ids, mask)
    first_mask = torch.cat([mask, torch.ones(2, NEW, dtype=torch.long)], 1)
    second = generate(model, cache, first, first_mask)
    once = model.generate(
        input_ids=ids,
        attention_mask=mask,
        cache=fresh(model),
        max_new_tokens=2 * NEW,
        min_new_tokens=2 * NEW,
        do_sample=False,
    )
    assert torch.equal(second, once)


def test_fork_then_a_question_equals_a_fresh_cache(model: PreTrainedModel) -> None:
    ids, mask = padded_batch([44, 44], seed=4)
    cache = fresh(model)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    outputs = []
    for seed in (5, 6):
        q = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(seed))
        full, full_mask = torch.cat([ids, q], 1), torch.cat([mask, torch.ones_like(q)], 1)
        forked = generate(model, cache.fork(), full, full_mask)
        again = fresh(model)
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=again)
        assert torch.equal(forked, generate(model, again, full, full_mask))
        outputs.append(forked)
    assert not torch.equal(outputs[0], outputs[1])
    # a fork of a cache that holds a question is refused another context too
    forked = cache.fork()
    other, other_mask = padded_batch([50, 50], seed=9)
    with pytest.raises(ValueError, match="does not begin with the tokens it holds"):
        generate(model, forked, other, other_mask)


def test_a_cache_without_recorded_tokens_still_checks_lengths(model: PreTrainedModel) -> None:
    """from_states fills a cache without a forward: ids are unknown, the length check still holds."""
    ids, mask = padded_batch([40, 40], seed=10)
    states, _ = ckv.prefill(model, ids, mask, window=WINDOW)
    cache = ckv.CompressedCache.from_states(states, "snapkv", 0.3)
    q = torch.randint(3, 100, (2, 4), generator=torch.Generator().manual_seed(11))
    full, full_mask = torch.cat([ids, q], 1), torch.cat([mask, torch.ones_like(q)], 1)
    generate(model, cache.fork(), full, full_mask)  # a continuation
    with pytest.raises(ValueError, match="already holds"):
        generate(model, cache, q, torch.ones_like(q))


def test_the_runtime_question_agnostic_generate_still_works() -> None:
    """criticalkv.generate prefills the context, then generate continues with context + question."""
    from tests.helpers.tiny_tokenizer import char_tokenizer

    tiny = ckv.attach(make_tiny("qwen2"))
    tokenizer = char_tokenizer()
    result = ckv.generate(
        tiny, tokenizer, "word " * 80, "what?", mode="question-agnostic", max_new_tokens=4, chat=False, window=8
    )
    assert len(result.answers) == 1 and result.context_tokens[0] > 8
