"""Oracle: decoding on the physical cache equals a full cache with evicted entries masked.

Runs on ``--device`` (tests/conftest.py): the models and inputs are built on the CPU, then moved."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import criticalkv as ckv
from criticalkv.compat import cache_argument
from tests.conftest import ARCHS, make_tiny, padded_batch, tolerance
from tests.helpers.prefill_paths import compressed_prefill
from tests.helpers.reference import KEEP
from tests.helpers.synthetic_scores import synthetic_head_scores

METHODS = ckv.available_methods()


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _models(arch: str, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    ours = ckv.attach(make_tiny(arch, device=device))
    ref = make_tiny(arch, device=device)
    ref.set_attn_implementation("masked_reference")
    return ours, ref


def _decode_compare(
    ours: torch.nn.Module,
    ref: torch.nn.Module,
    cache: ckv.CompressedCache,
    ref_cache: DynamicCache,
    mask: torch.Tensor,
    chunks: list[tuple[torch.Tensor, torch.Tensor]],
) -> float:
    """Feed each (ids, chunk_mask) to both models; return the worst logit difference."""
    token = KEEP.set(cache.keep_masks())
    worst = 0.0
    try:
        for ids, chunk_mask in chunks:
            mask = torch.cat([mask, chunk_mask], dim=1)
            pos = positions(mask)[:, -ids.shape[1] :]
            a = ours(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ours, cache)).logits
            b = ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ref, ref_cache)).logits
            real = chunk_mask.bool()
            worst = max(worst, float((a - b)[real].abs().max()))
    finally:
        KEEP.reset(token)
    return worst


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_decode_matches_masked_full_cache(arch: str, method: str, device: torch.device) -> None:
    ours, ref = _models(arch, device)
    ids, mask = padded_batch([48, 37], seed=1, device=device)
    atol = tolerance(1e-4, device)  # the reference is float64; the accelerator's float32 kernels differ more
    pos = positions(mask)
    # head-prior methods need head scores: synthetic ones for the tiny model (ignored by the others)
    cache, logits = compressed_prefill(ours, method, 0.3, ids, mask, window=6, head_scores=synthetic_head_scores(ours))
    ref_cache = DynamicCache(config=ref.config)
    ref_out = ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ref, ref_cache))
    real = mask.bool()
    assert float((logits - ref_out.logits)[real].abs().max()) < atol  # prefill is uncompressed

    # question-agnostic style: a padded multi-token chunk, then single-token decode steps
    g = torch.Generator().manual_seed(2)
    question = torch.randint(3, 100, (2, 5), generator=g)
    q_mask = torch.ones(2, 5, dtype=torch.long)
    q_mask[1, :2] = 0
    chunks = [(question, q_mask)]
    chunks += [(torch.randint(3, 100, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.long)) for _ in range(6)]
    chunks = [(chunk.to(device), chunk_mask.to(device)) for chunk, chunk_mask in chunks]
    worst = _decode_compare(ours, ref, cache, ref_cache, mask, chunks)
    assert worst < atol, f"{method} on {arch} ({device}): logits differ by {worst}"


@torch.no_grad()
def test_compressed_differs_from_full(device: torch.device) -> None:
    """The oracle can fail: a compressed cache changes decode logits versus the full cache."""
    ours = ckv.attach(make_tiny("llama", device=device))
    ids, mask = padded_batch([60], seed=3, device=device)
    full = ckv.CompressedCache.for_model(ours, "full", 1.0, window=4)
    small = ckv.CompressedCache.for_model(ours, "snapkv", 0.2, window=4)
    logits = []
    for cache in (full, small):
        ours(input_ids=ids, attention_mask=mask, **cache_argument(ours, cache))
        nxt = torch.tensor([[5]], device=device)
        step_mask = torch.ones(1, 61, dtype=torch.long, device=device)
        logits.append(ours(input_ids=nxt, attention_mask=step_mask, **cache_argument(ours, cache)).logits)
    assert float((logits[0] - logits[1]).abs().max()) > 1e-3


@torch.no_grad()
def test_prefill_states_compress_like_inflight(device: torch.device) -> None:
    """Capture once, compress later: same kept entries and logits as compressing in flight."""
    model = ckv.attach(make_tiny("qwen2", device=device))
    ids, mask = padded_batch([50, 44], seed=4, device=device)
    pos = positions(mask)
    capture = ckv.CaptureCache(model.config.num_hidden_layers, window=5)
    model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(model, capture))
    states = capture.states()
    for method in ("snapkv", "critical-adakv"):
        inflight = ckv.CompressedCache.for_model(model, method, 0.25, window=5)
        model(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(model, inflight))
        derived = ckv.CompressedCache.from_states(states, method, 0.25)
        for a, b in zip(inflight.keep_masks(), derived.keep_masks(), strict=True):
            assert torch.equal(a, b)
        nxt = torch.tensor([[7], [9]], device=device)
        m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long, device=device)], 1)
        la = model(
            input_ids=nxt, attention_mask=m2, position_ids=positions(m2)[:, -1:], **cache_argument(model, inflight)
        ).logits
        lb = model(
            input_ids=nxt, attention_mask=m2, position_ids=positions(m2)[:, -1:], **cache_argument(model, derived)
        ).logits
        assert torch.allclose(la, lb, atol=tolerance(1e-5, device))  # the same kernels on two caches


@pytest.mark.parametrize("method", ["snapkv", "critical-snapkv", "critical-adakv", "layer-defensivekv"])
@torch.no_grad()
def test_bfloat16_decode_matches_its_masked_full_cache(method: str) -> None:
    """The CPU default where bfloat16 runs in hardware: the physical cache of a bfloat16 model
    decodes as the same bfloat16 model's full cache with the evicted entries masked, to within
    bfloat16's rounding (the selection's scores are computed in float32 inside)."""
    device = torch.device("cpu")
    ours, ref = (model.to(torch.bfloat16) for model in _models("llama", device))
    ids, mask = padded_batch([48, 37], seed=3)
    cache, _ = compressed_prefill(ours, method, 0.3, ids, mask, window=6)
    assert cache.compressed_layers[0].dtype == torch.bfloat16
    ref_cache = DynamicCache(config=ref.config)
    ref(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(ref, ref_cache))
    g = torch.Generator().manual_seed(4)
    steps = [(torch.randint(3, 100, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.long)) for _ in range(6)]
    worst = _decode_compare(ours, ref, cache, ref_cache, mask, steps)
    assert worst < 0.02, f"{method} in bfloat16: logits differ by {worst}"  # unmasked: 0.2
