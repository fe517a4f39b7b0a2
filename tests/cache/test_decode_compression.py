"""Decode-time compression: the oracle over random schedules, the memory bound, padding, forks,
value norms computed once per entry, and the errors before any work."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, PreTrainedModel

import criticalkv as ckv
import criticalkv.cache.decode.budget as decode_module
from criticalkv.compat import cache_argument
from criticalkv.prompts import positions
from tests.conftest import ARCHS, make_tiny, padded_batch
from tests.helpers.reference import KEEP
from tests.helpers.synthetic_scores import synthetic_head_scores

#: every registered method that can re-select while decoding
DECODING = [m for m in ckv.available_methods() if m != "full" and not ckv.get_method(m).needs.prefill_only]
#: budgets the same for every layer: each layer is held to decode_budget + interval on average
LAYER_UNIFORM = [
    m
    for m in DECODING
    if m not in ("pyramidkv", "critical-pyramidkv", "headkv", "critical-headkv") and not ckv.get_method(m).cross_layer
]
#: budgets over all layers (layer-defensivekv): each layer is held to its share of the model's decode budget
JOINT = [m for m in DECODING if ckv.get_method(m).cross_layer]
_MODELS: dict[str, tuple[PreTrainedModel, PreTrainedModel]] = {}


def models(arch: str) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The tiny model routed through criticalkv, and the same weights on the masked reference."""
    if arch not in _MODELS:
        ref = make_tiny(arch)
        ref.set_attn_implementation("masked_reference")
        _MODELS[arch] = (ckv.attach(make_tiny(arch)), ref)
    return _MODELS[arch]


def new_cache(model: PreTrainedModel, method: str, budget: float, window: int, **decode: Any) -> ckv.CompressedCache:
    return ckv.CompressedCache.for_model(
        model, method, budget, window=window, head_scores=synthetic_head_scores(model), **decode
    )


def generate_exactly(
    model: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor, cache: ckv.CompressedCache, tokens: int
) -> None:
    """Greedy ``model.generate`` of exactly ``tokens`` new tokens on ``cache``."""
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        **cache_argument(model, cache),
    )


def held_average(cache: ckv.CompressedCache) -> torch.Tensor:
    """(L, B) entries per KV head on average that each layer holds (padding excluded: never kept)."""
    return cache.kept_entries().double().mean(-1)


@torch.no_grad()
def run_schedule(
    arch: str,
    method: str,
    lengths: list[int],
    prefill_budget: float,
    decode_budget: int,
    interval: int,
    window: int,
    steps: int,
    chunk: int,
    seed: int,
) -> tuple[float, ckv.CompressedCache, list[torch.Tensor]]:
    """Prefill, an optional padded chunk (a question), then ``steps`` single tokens, on our cache and
    on the reference masked by what the cache held before each forward. Returns the worst logit
    difference, the cache and the per-step (L, B) held averages."""
    ours, ref = models(arch)
    ids, mask = padded_batch(lengths, seed=seed)
    cache = new_cache(ours, method, prefill_budget, window, decode_budget=decode_budget, decode_interval=interval)
    ref_cache = DynamicCache(config=ref.config)
    pos = positions(mask)
    ours(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ours, cache))
    ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ref, ref_cache))
    g = torch.Generator().manual_seed(seed + 1)
    rows = len(lengths)
    feeds = []
    if chunk:
        chunk_mask = torch.ones(rows, chunk, dtype=torch.long)
        chunk_mask[-1, : chunk // 2] = 0  # the last row's chunk is left-padded
        feeds.append((torch.randint(3, 100, (rows, chunk), generator=g), chunk_mask))
    feeds += [
        (torch.randint(3, 100, (rows, 1), generator=g), torch.ones(rows, 1, dtype=torch.long)) for _ in range(steps)
    ]
    worst, held = 0.0, []
    for tokens, new_mask in feeds:
        mask = torch.cat([mask, new_mask], dim=1)
        pos = positions(mask)[:, -tokens.shape[1] :]
        token = KEEP.set(cache.keep_masks())  # what each layer holds before this step: the reference's mask
        try:
            a = ours(input_ids=tokens, attention_mask=mask, position_ids=pos, **cache_argument(ours, cache)).logits
            b = ref(input_ids=tokens, attention_mask=mask, position_ids=pos, **cache_argument(ref, ref_cache)).logits
        finally:
            KEEP.reset(token)
        worst = max(worst, float((a - b)[new_mask.bool()].abs().max()))
        held.append(held_average(cache))
    return worst, cache, held


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    arch=st.sampled_from(ARCHS),
    method=st.sampled_from(DECODING),
    lengths=st.lists(st.integers(24, 44), min_size=1, max_size=3),
    prefill_budget=st.sampled_from([0.3, 0.6, 1.0]),
    extra=st.integers(0, 10),
    interval=st.integers(1, 6),
    window=st.integers(2, 5),
    steps=st.integers(8, 22),
    chunk=st.sampled_from([0, 4]),
    seed=st.integers(0, 1000),
)
def test_logits_equal_the_reference_masked_by_every_reselection(
    arch: str,
    method: str,
    lengths: list[int],
    prefill_budget: float,
    extra: int,
    interval: int,
    window: int,
    steps: int,
    chunk: int,
    seed: int,
) -> None:
    decode_budget = window + extra
    worst, cache, held = run_schedule(
        arch, method, lengths, prefill_budget, decode_budget, interval, window, steps, chunk, seed
    )
    assert worst < 1e-4, f"{method} on {arch}: logits differ by {worst}"
    assert cache.decode is not None
    real_prompt = torch.tensor(lengths)
    # the prompt's padding (left of each row's real tokens) is never held, by any head of any layer
    width = max(lengths)
    for keep in cache.keep_masks():
        pad = torch.arange(width)[None, :] < (width - real_prompt)[:, None]
        assert not bool((keep[..., :width] & pad[:, None, :]).any())
        if chunk:  # nor the padding of the appended chunk (held only if no re-selection happened since)
            assert not bool(keep[-1, :, width : width + chunk // 2].any())
    if method in LAYER_UNIFORM:
        # after every step a layer holds at most decode_budget + interval per head on average (plus the
        # chunk's padding while it sits in the tail, before a re-selection drops it)
        bound = decode_budget + interval + chunk // 2
        for step_held in held:
            assert bool((step_held <= bound + 1e-9).all()), step_held
    if method in JOINT:
        # the layers' shares sum to L x decode_budget, so together they hold at most L x (budget + interval)
        bound = len(cache.compressed_layers) * (decode_budget + interval + chunk // 2)
        for step_held in held:
            assert bool((step_held.sum(0) <= bound + 1e-9).all()), step_held
    assert cache.kv_bytes_peak() >= cache.kv_bytes()


def test_reselection_happens_and_the_oracle_can_fail() -> None:
    """Guards the property test: decode budgets re-select (entries are evicted) and change logits."""
    worst, cache, held = run_schedule("llama", "snapkv", [40, 30], 1.0, 8, 2, 4, 20, 0, seed=3)
    assert worst < 1e-4
    assert cache.decode is not None and cache.decode.reselections > 0
    assert float(held[-1].max()) <= 8 + 2
    ours, _ = models("llama")
    ids, mask = padded_batch([40, 30], seed=3)
    full = new_cache(ours, "snapkv", 1.0, 4)
    bounded = new_cache(ours, "snapkv", 1.0, 4, decode_budget=8, decode_interval=2)
    out = []
    for cache in (full, bounded):
        step_mask = mask
        with torch.no_grad():
            ours(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(ours, cache))
            for _ in range(6):
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=torch.long)], 1)
                tok = torch.full((2, 1), 7)
                logits = ours(
                    input_ids=tok,
                    attention_mask=step_mask,
                    position_ids=positions(step_mask)[:, -1:],
                    **cache_argument(ours, cache),
                ).logits
        out.append(logits)
    assert float((out[0] - out[1]).abs().max()) > 1e-3


@torch.no_grad()
def test_memory_stays_bounded_through_generate() -> None:
    """model.generate with a decode budget: bytes stay at budget + interval + 1 entries per head."""
    model, _ = models("qwen2")
    ids, mask = padded_batch([40, 33], seed=5)
    budget, interval = 10, 4
    cache = new_cache(model, "critical-adakv", 0.5, 4, decode_budget=budget, decode_interval=interval)
    generate_exactly(model, ids, mask, cache, 60)
    layers = cache.compressed_layers
    entry = 2 * layers[0].head_dim * 4  # float32 keys + values
    spare = tail_spare()
    bound = len(layers) * layers[0].batch_size * layers[0].num_kv_heads * (budget + interval + spare) * entry
    assert cache.kv_bytes_peak() <= bound
    assert cache.get_seq_length() == ids.shape[1] + 59  # positions continue: the logical length grows
    assert cache.kv_bytes_full() > cache.kv_bytes()
    plain = new_cache(model, "critical-adakv", 0.5, 4)
    generate_exactly(model, ids, mask, plain, 60)
    assert plain.kv_bytes_full() == cache.kv_bytes_full()  # the same tokens, uncompressed


def tail_spare() -> int:
    """The tail's spare room: sized to the interval, it holds at most one entry beyond
    ``budget + interval`` (the one whose step re-selects the layer)."""
    return 1


@torch.no_grad()
def test_fork_decodes_like_an_independent_cache() -> None:
    model, _ = models("mistral")
    ids, mask = padded_batch([36, 28], seed=7)
    options = {"decode_budget": 9, "decode_interval": 3}

    def decode(cache: ckv.CompressedCache, token: int) -> torch.Tensor:
        step_mask, outs = mask, []
        for _ in range(15):
            step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=torch.long)], 1)
            tokens = torch.full((2, 1), token)
            pos = positions(step_mask)[:, -1:]
            outs.append(
                model(
                    input_ids=tokens, attention_mask=step_mask, position_ids=pos, **cache_argument(model, cache)
                ).logits
            )
        return torch.cat(outs, 1)

    def prefilled() -> ckv.CompressedCache:
        cache = new_cache(model, "critical-snapkv", 0.5, 4, **options)
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache))
        return cache

    original = prefilled()
    fork = original.fork()
    a, b = decode(fork, 11), decode(original, 23)  # the fork first: the original must not see its steps
    # close, not bitwise: until its first re-selection the fork reads the shared tiers (tier kernel),
    # an owned cache its length buckets (sdpa)
    torch.testing.assert_close(a, decode(prefilled(), 11), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b, decode(prefilled(), 23), rtol=1e-5, atol=1e-5)
    assert fork.decode is not None and fork.decode.reselections > 0


@torch.no_grad()
def test_value_norms_are_computed_once_per_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = models("llama")
    ids, mask = padded_batch([30], seed=9)
    seen: list[int] = []
    original = decode_module.projected_value_norms

    def counting(values: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(int(values.shape[2]))
        return original(values, *args, **kwargs)

    monkeypatch.setattr(decode_module, "projected_value_norms", counting)
    cache = new_cache(model, "critical-adakv", 1.0, 4, decode_budget=8, decode_interval=2)
    generate_exactly(model, ids, mask, cache, 25)
    assert cache.decode is not None and cache.decode.reselections >= 3 * 5
    # each generated entry once per layer, at the first re-selection it took part in (those still in the
    # tail have none yet); the prompt's came from the prefill selection
    assert sum(seen) == sum(24 - layer.tail_len for layer in cache.compressed_layers)
    assert all(layer.tail_len < 24 for layer in cache.compressed_layers)


# --- bad input, before any work ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "decode", "message"),
    [
        ("snapkv", {"decode_budget": 3}, "below the observation window"),
        ("snapkv", {"decode_budget": 16, "decode_interval": 0}, "positive number"),
        ("snapkv", {"decode_budget": 16.5}, "an int"),
        ("snapkv", {"decode_budget": True}, "an int"),
        ("h2o", {"decode_budget": 16}, "every prompt query"),
        ("kvzip", {"decode_budget": 16}, "the prompt's reconstruction"),
        ("full", {"decode_budget": 16}, "keeps every entry"),
    ],
)
def test_bad_decode_budgets_are_refused(method: str, decode: dict[str, Any], message: str) -> None:
    model, _ = models("llama")
    with pytest.raises((ValueError, TypeError), match=message):
        new_cache(model, method, 0.5, 4, **decode)
