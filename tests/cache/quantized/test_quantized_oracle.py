"""Oracle: decoding on a quantized compressed cache equals a masked full cache whose kept keys
and values are replaced by their quantize-dequantize values (tests/helpers/quantized_reference.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import criticalkv as ckv
from criticalkv.compat import cache_argument
from criticalkv.runtime import capture_prefill
from tests.conftest import ARCHS, make_tiny, padded_batch, tolerance
from tests.helpers.prefill_paths import TINY_REPEAT
from tests.helpers.quantized_reference import QUANT, Quantized
from tests.helpers.reference import KEEP
from tests.helpers.synthetic_scores import synthetic_head_scores

METHODS = ckv.available_methods()


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _chunks(device: torch.device, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A padded 5-token question (question-agnostic append), then single-token decode steps."""
    g = torch.Generator().manual_seed(2)
    q_mask = torch.ones(2, 5, dtype=torch.long)
    q_mask[1, :2] = 0
    chunks = [(torch.randint(3, 100, (2, 5), generator=g), q_mask)]
    chunks += [(torch.randint(3, 100, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.long)) for _ in range(steps)]
    return [(ids.to(device), m.to(device)) for ids, m in chunks]


def run_against_reference(
    arch: str, method: str, bits: int, device: torch.device, group: int = 4, residual: int = 4, steps: int = 8
) -> float:
    """The worst logit difference over the prefill, the appended question and the decode steps."""
    ours = ckv.attach(make_tiny(arch, device=device))
    ref = make_tiny(arch, device=device)
    ref.set_attn_implementation("quantized_reference")
    ids, mask = padded_batch([48, 37], seed=1, device=device)
    pos = positions(mask)
    storage = {"kv_bits": bits, "kv_group_size": group, "kv_residual": residual}
    bound = ckv.bind(ckv.get_method(method), ours, synthetic_head_scores(ours))
    if bound.needs.reconstruction:  # KVzip: the runtime's captured prefill + reconstruction pass
        n = int(ids.shape[1])
        states, logits = capture_prefill(
            ours, ids, mask, window=6, num_queries=n, logits_to_keep=n, reconstruction=TINY_REPEAT
        )
        cache = ckv.CompressedCache.from_states(states, bound, 0.3, window=6, **storage)
    else:
        cache = ckv.CompressedCache(ours.config.num_hidden_layers, bound, 0.3, window=6, **storage)
        logits = ours(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ours, cache)).logits
    ref_cache = DynamicCache(config=ref.config)
    ref_out = ref(input_ids=ids, attention_mask=mask, position_ids=pos, **cache_argument(ref, ref_cache))
    worst = float((logits - ref_out.logits)[mask.bool()].abs().max())  # the prefill is not quantized
    keeps = cache.keep_masks()
    tokens = (KEEP.set(keeps), QUANT.set(Quantized(keeps, bits, group, residual)))
    try:
        for chunk, chunk_mask in _chunks(device, steps):
            mask = torch.cat([mask, chunk_mask], dim=1)
            p = positions(mask)[:, -chunk.shape[1] :]
            a = ours(input_ids=chunk, attention_mask=mask, position_ids=p, **cache_argument(ours, cache)).logits
            b = ref(input_ids=chunk, attention_mask=mask, position_ids=p, **cache_argument(ref, ref_cache)).logits
            worst = max(worst, float((a - b)[chunk_mask.bool()].abs().max()))
    finally:
        KEEP.reset(tokens[0])
        QUANT.reset(tokens[1])
    layer = cache.compressed_layers[0]
    assert layer.storage.tail_used >= 1 and layer.storage.residual_len >= residual  # type: ignore[attr-defined]
    return worst


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_quantized_decode_matches_reference(arch: str, method: str, device: torch.device) -> None:
    worst = run_against_reference(arch, method, 4, device)
    assert worst < tolerance(1e-4, device), f"{method} on {arch}, 4 bits: logits differ by {worst}"


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_8_bit_matches_reference(arch: str, device: torch.device) -> None:
    worst = run_against_reference(arch, "critical-adakv", 8, device, group=8, residual=0)
    assert worst < tolerance(1e-4, device)


@torch.no_grad()
def test_reference_can_fail(device: torch.device) -> None:
    """The oracle can fail: a reference that does not quantize differs from the 4-bit cache."""
    ours = ckv.attach(make_tiny("llama", device=device))
    ids, mask = padded_batch([48, 37], seed=1, device=device)
    logits = []
    for bits in (16, 4):
        cache = ckv.CompressedCache.for_model(
            ours, "snapkv", 0.3, window=6, **({} if bits == 16 else {"kv_bits": bits, "kv_group_size": 4})
        )
        ours(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(ours, cache))
        m2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long, device=device)], 1)
        nxt = torch.tensor([[7], [9]], device=device)
        p = positions(m2)[:, -1:]
        logits.append(ours(input_ids=nxt, attention_mask=m2, position_ids=p, **cache_argument(ours, cache)).logits)
    assert float((logits[0] - logits[1]).abs().max()) > 1e-3
