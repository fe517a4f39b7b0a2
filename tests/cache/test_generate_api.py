"""``model.generate`` with a CompressedCache: same tokens as a hand-written greedy loop, forks,
repeated rows, beam search, and a clear error on a model that was not attached."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedModel

import criticalkv as ckv
from criticalkv.prompts import positions
from tests.conftest import _COMMON, ARCHS, make_tiny, padded_batch

WINDOW = 6
NEW = 12
LENGTHS = [48, 37]  # batch 2, the second row left-padded


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    return {arch: ckv.attach(make_tiny(arch)) for arch in ARCHS}


def cache_for(
    model: PreTrainedModel,
    method: str = "critical-adakv",
    budget: float = 0.3,
) -> ckv.CompressedCache:
    return ckv.CompressedCache.for_model(model, method, budget, window=WINDOW)


def ones(rows: int, cols: int = 1) -> torch.Tensor:
    return torch.ones(rows, cols, dtype=torch.long)


@torch.no_grad()
def greedy_by_hand(
    model: PreTrainedModel, cache: ckv.CompressedCache, ids: torch.Tensor, mask: torch.Tensor, steps: int
) -> torch.Tensor:
    """Feed the uncached part of ``ids`` (all of it for an empty cache), then one token at a time.

    Positions come from the attention mask, so they continue from the real (uncompressed)
    prompt length of each row whatever the cache kept.
    """
    cached = cache.get_seq_length()
    logits = model(
        input_ids=ids[:, cached:],
        attention_mask=mask,
        position_ids=positions(mask)[:, cached:],
        cache=cache,
    ).logits
    tokens = []
    for step in range(steps):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        if step + 1 == steps:
            break
        mask = torch.cat([mask, ones(mask.shape[0])], dim=1)
        pos = positions(mask)[:, -1:]
        logits = model(input_ids=token, attention_mask=mask, position_ids=pos, cache=cache).logits
    return torch.cat(tokens, dim=1)


def generate(
    model: PreTrainedModel, cache: object, ids: torch.Tensor, mask: torch.Tensor, **kwargs: object
) -> torch.Tensor:
    options: dict[str, object] = {"max_new_tokens": NEW, "min_new_tokens": NEW, "do_sample": False}
    options.update(kwargs)
    out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **options)
    return out[:, ids.shape[1] :]


@torch.no_grad()
def compress_context(
    model: PreTrainedModel, method: str = "critical-adakv"
) -> tuple[ckv.CompressedCache, torch.Tensor, torch.Tensor]:
    ids, mask = padded_batch(LENGTHS, seed=1)
    cache = cache_for(model, method)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    return cache, ids, mask


def question(seed: int, rows: int = 2, length: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (rows, length), generator=g), ones(rows, length)


# --- generate == a greedy loop by hand -----------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["snapkv", "critical-adakv"])
def test_generate_equals_greedy_loop(models: dict[str, PreTrainedModel], arch: str, method: str) -> None:
    model = models[arch]
    ids, mask = padded_batch(LENGTHS, seed=0)
    via_generate = generate(model, cache_for(model, method), ids, mask)
    by_hand = greedy_by_hand(model, cache_for(model, method), ids, mask, NEW)
    assert via_generate.shape == (2, NEW)
    assert torch.equal(via_generate, by_hand)


def test_full_method_generates_like_a_plain_cache(models: dict[str, PreTrainedModel]) -> None:
    model = models["llama"]
    ids, mask = padded_batch(LENGTHS, seed=0)
    ours = generate(model, cache_for(model, "full", 1.0), ids, mask)
    plain = generate(model, DynamicCache(config=model.config), ids, mask)
    assert torch.equal(ours, plain)


def test_compression_changes_the_continuation(models: dict[str, PreTrainedModel]) -> None:
    """Guards the comparisons above: a small budget does change what is generated."""
    model = models["llama"]
    ids, mask = padded_batch(LENGTHS, seed=0)
    full = generate(model, cache_for(model, "full", 1.0), ids, mask, max_new_tokens=30, min_new_tokens=30)
    small = generate(model, cache_for(model, "snapkv", 0.2), ids, mask, max_new_tokens=30, min_new_tokens=30)
    assert not torch.equal(full, small)


@pytest.mark.parametrize("arch", ARCHS)
def test_question_after_compressed_context(models: dict[str, PreTrainedModel], arch: str) -> None:
    """Question-agnostic use: compress the context, then generate from context + question."""
    model = models[arch]
    cache, ids, mask = compress_context(model)
    q_ids, q_mask = question(3)
    q_mask[1, :2] = 0  # the second question is shorter (padding inside the appended chunk)
    full_ids, full_mask = torch.cat([ids, q_ids], 1), torch.cat([mask, q_mask], 1)
    via_generate = generate(model, cache, full_ids, full_mask)
    again, _, _ = compress_context(model)
    assert torch.equal(via_generate, greedy_by_hand(model, again, full_ids, full_mask, NEW))


# --- fork ----------------------------------------------------------------------------------------


def test_fork_gives_independent_continuations(models: dict[str, PreTrainedModel]) -> None:
    model = models["mistral"]
    cache, ids, mask = compress_context(model)
    prefix_bytes = cache.kv_bytes()
    (qa, qa_mask), (qb, qb_mask) = question(4), question(5, length=7)
    a, b = cache.fork(), cache.fork()
    out_a = generate(model, a, torch.cat([ids, qa], 1), torch.cat([mask, qa_mask], 1))
    out_b = generate(model, b, torch.cat([ids, qb], 1), torch.cat([mask, qb_mask], 1))
    assert not torch.equal(out_a, out_b)
    # the forks shared the compressed prompt and never wrote to it
    assert cache.kv_bytes() == prefix_bytes
    assert all(layer.tail_len == 0 for layer in cache.compressed_layers)
    assert a.get_seq_length() == ids.shape[1] + qa.shape[1] + NEW - 1
    assert b.get_seq_length() == ids.shape[1] + qb.shape[1] + NEW - 1
    # a third fork, after both, continues exactly like the first; so does a fresh compression
    again = generate(model, cache.fork(), torch.cat([ids, qa], 1), torch.cat([mask, qa_mask], 1))
    assert torch.equal(again, out_a)
    fresh, _, _ = compress_context(model)
    assert torch.equal(generate(model, fresh, torch.cat([ids, qa], 1), torch.cat([mask, qa_mask], 1)), out_a)


def test_fork_needs_a_compressed_prompt(models: dict[str, PreTrainedModel]) -> None:
    with pytest.raises(ValueError, match="compressed prompt"):
        cache_for(models["llama"]).fork()


# --- repeated rows and beams ---------------------------------------------------------------------


def test_num_return_sequences_with_an_empty_cache(models: dict[str, PreTrainedModel]) -> None:
    """generate repeats the prompt rows before the prefill: the cache compresses 4 rows.
    With top_k=1, sampling is greedy, so each copy equals the greedy continuation of its row."""
    model = models["qwen2"]
    ids, mask = padded_batch(LENGTHS, seed=0)
    greedy = generate(model, cache_for(model), ids, mask)
    torch.manual_seed(0)
    repeated = generate(model, cache_for(model), ids, mask, do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(repeated, greedy.repeat_interleave(2, dim=0))


def test_num_return_sequences_on_a_filled_cache_fails_clearly(models: dict[str, PreTrainedModel]) -> None:
    """A filled cache is not repeated by generate: the row mismatch is reported, not a shape error."""
    model = models["llama"]
    cache, ids, mask = compress_context(model)
    q_ids, q_mask = question(8)
    full_ids, full_mask = torch.cat([ids, q_ids], 1), torch.cat([mask, q_mask], 1)
    with pytest.raises(ValueError, match="holds 2 rows but 4"):
        generate(model, cache, full_ids, full_mask, do_sample=True, top_k=1, num_return_sequences=2)


def test_batch_repeat_interleave_then_generate(models: dict[str, PreTrainedModel]) -> None:
    """Repeating a filled cache's rows by hand makes num_return_sequences work."""
    model = models["llama"]
    q_ids, q_mask = question(6)
    cache, ids, mask = compress_context(model)
    full_ids, full_mask = torch.cat([ids, q_ids], 1), torch.cat([mask, q_mask], 1)
    greedy = generate(model, cache.fork(), full_ids, full_mask)
    cache.batch_repeat_interleave(2)
    assert cache.compressed_layers[0].batch_size == 4
    torch.manual_seed(0)
    repeated = generate(model, cache, full_ids, full_mask, do_sample=True, top_k=1, num_return_sequences=2)
    assert torch.equal(repeated, greedy.repeat_interleave(2, dim=0))


@torch.no_grad()
def test_batch_select_indices_keeps_the_tail(models: dict[str, PreTrainedModel]) -> None:
    """Selecting rows after the tail has entries: each row decodes as it did before."""
    model = models["qwen2"]
    q_ids, q_mask = question(7)
    caches = []
    for _ in range(2):  # two identical caches: compressed context plus an appended question
        cache, _, mask = compress_context(model)
        full_mask = torch.cat([mask, q_mask], 1)
        q_pos = positions(full_mask)[:, -5:]
        model(input_ids=q_ids, attention_mask=full_mask, position_ids=q_pos, cache=cache)
        caches.append(cache)
    reference, cache = caches
    step_mask = torch.cat([full_mask, ones(2)], 1)
    token, pos = torch.tensor([[11], [12]]), positions(step_mask)[:, -1:]
    want = model(input_ids=token, attention_mask=step_mask, position_ids=pos, cache=reference).logits
    order = torch.tensor([1, 0, 1])
    cache.batch_select_indices(order)
    got = model(
        input_ids=token[order],
        attention_mask=step_mask[order],
        position_ids=pos[order],
        cache=cache,
    ).logits
    assert torch.allclose(got, want[order], atol=1e-5)
    for layer, ref_layer in zip(cache.compressed_layers, reference.compressed_layers, strict=True):
        assert layer.tail_len == ref_layer.tail_len == 6
        assert layer.keep is not None and ref_layer.keep is not None
        assert torch.equal(layer.keep, ref_layer.keep[order])
        assert torch.equal(layer.kept_per_head(), ref_layer.kept_per_head()[order])


def test_beam_search_runs_and_matches_a_plain_cache_when_nothing_is_evicted(
    models: dict[str, PreTrainedModel],
) -> None:
    model = models["llama"]
    ids, mask = padded_batch(LENGTHS, seed=0)
    ours = generate(model, cache_for(model, "full", 1.0), ids, mask, num_beams=2)
    plain = generate(model, DynamicCache(config=model.config), ids, mask, num_beams=2)
    assert torch.equal(ours, plain)
    compressed = generate(model, cache_for(model), ids, mask, num_beams=2)
    assert compressed.shape == (2, NEW)


# --- not attached --------------------------------------------------------------------------------


@torch.no_grad()
def test_unattached_model_raises(models: dict[str, PreTrainedModel]) -> None:
    model = make_tiny("llama")  # never attached
    ids, mask = padded_batch(LENGTHS, seed=0)
    with pytest.raises(RuntimeError, match="attach"):
        model(input_ids=ids, attention_mask=mask, cache=cache_for(model))
    with pytest.raises(RuntimeError, match="attach"):
        generate(model, cache_for(model), ids, mask)
    # the failure leaves nothing behind: an attached model still works afterwards
    attached = models["llama"]
    by_hand = greedy_by_hand(attached, cache_for(attached), ids, mask, NEW)
    assert torch.equal(generate(attached, cache_for(attached), ids, mask), by_hand)


@torch.no_grad()
def test_unattached_one_layer_model_raises() -> None:
    """With a single layer no later layer notices the unclaimed hand-off; the next step must."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_hidden_layers": 1}, head_dim=16)).eval()
    ids, mask = padded_batch(LENGTHS, seed=0)
    with pytest.raises(RuntimeError, match="attach"):
        generate(model, cache_for(model), ids, mask)
