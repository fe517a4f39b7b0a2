"""The compressed cache really is small: bytes follow kept entries, and decoding grows it by
the generated tokens only, with bounded spare tail capacity. Runs on ``--device`` (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.budgets import HeadPrior, LayerJoint, Pyramid
from criticalkv.cache import CompressedLayer
from tests.conftest import ARCHS, make_tiny, padded_batch
from tests.helpers.prefill_paths import compressed_prefill
from tests.helpers.synthetic_scores import synthetic_head_scores

METHODS = ckv.available_methods()
LENGTHS = [200, 170]  # batch 2, the second row left-padded
WINDOW = 8
NEW_TOKENS = 150


@pytest.fixture(scope="module")
def models(device: torch.device) -> dict[str, PreTrainedModel]:
    return {arch: ckv.attach(make_tiny(arch, device=device)) for arch in ARCHS}


def entry_bytes(layer: CompressedLayer) -> int:
    """Bytes of one cache entry of one head: a key and a value of ``head_dim``."""
    return 2 * layer.head_dim * torch.empty((), dtype=layer.dtype).element_size()


def exact_bytes(cache: ckv.CompressedCache) -> int:
    """Kept prompt entries plus allocated tail capacity, per head, in bytes."""
    total = 0
    for layer in cache.compressed_layers:
        assert layer.holds_prompt
        segments = layer.batch_size * layer.num_kv_heads
        total += (layer.storage.prefix.num_entries + segments * layer.tail_capacity()) * entry_bytes(layer)
    return total


def check_spare_capacity(cache: ckv.CompressedCache) -> None:
    for layer in cache.compressed_layers:
        if not layer.holds_prompt:  # generate shows the prompt to the streamer before the prefill
            continue
        spare = layer.tail_capacity() - layer.tail_len
        held = layer.kept_per_head().cpu()  # float64 below (which MPS lacks)
        assert spare >= 0
        limit = torch.clamp(0.125 * held.double(), min=64.0)
        assert bool((spare <= limit).all()), (layer.layer_idx, spare, held.tolist())


@torch.no_grad()
def prefill(model: PreTrainedModel, method: str, budget: float) -> ckv.CompressedCache:
    ids, mask = padded_batch(LENGTHS, seed=0, device=model.device)
    scores = synthetic_head_scores(model)
    cache, _ = compressed_prefill(model, method, budget, ids, mask, window=WINDOW, head_scores=scores)
    return cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [0.2, 0.5])
def test_kv_bytes_follow_kept_entries(
    models: dict[str, PreTrainedModel], arch: str, method: str, budget: float
) -> None:
    cache = prefill(models[arch], method, budget)
    kept = cache.kept_entries()
    layer = cache.compressed_layers[0]
    expected = int(kept.sum()) * entry_bytes(layer)
    assert abs(cache.kv_bytes() - expected) <= 0.02 * expected
    full = sum(LENGTHS) * layer.num_kv_heads * len(cache.compressed_layers) * entry_bytes(layer)
    assert cache.kv_bytes_full() == full
    if method == "full":
        assert cache.kv_bytes() == full
    else:
        assert cache.kv_bytes() <= (budget + 0.02) * full
        # every head holds its budget: floor(budget * length) per row on average
        per_row = torch.tensor([int(budget * n) for n in LENGTHS], device=kept.device)
        if isinstance(cache.method.budgets, (Pyramid, HeadPrior, LayerJoint)):  # vary by layer: same total
            assert torch.equal(kept.sum((0, 2)), kept.shape[0] * layer.num_kv_heads * per_row)
            assert bool((kept >= WINDOW).all())
        else:
            assert torch.equal(kept.sum(-1), layer.num_kv_heads * per_row[None].expand(kept.shape[0], -1))


class CacheInspector:
    """A ``generate`` streamer that checks the cache after every step."""

    def __init__(self, cache: ckv.CompressedCache) -> None:
        self.cache = cache
        self.steps = 0
        self.sizes: list[int] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.steps += 1
        if not self.cache.compressed_layers[0].holds_prompt:
            return
        check_spare_capacity(self.cache)
        assert self.cache.kv_bytes() == exact_bytes(self.cache)
        self.sizes.append(self.cache.kv_bytes())

    def end(self) -> None:
        self.ended = True


@pytest.mark.parametrize("method", METHODS)
@torch.no_grad()
def test_decoding_grows_the_cache_by_the_generated_tokens(
    models: dict[str, PreTrainedModel],
    method: str,
) -> None:
    if ckv.get_method(method).needs.reconstruction:
        pytest.skip("compresses captured states after a reconstruction pass, not inside generate's prefill")
    model = models["llama"]
    budget = 0.2
    ids, mask = padded_batch(LENGTHS, seed=0, device=model.device)
    compressed_prompt = prefill(model, method, budget)
    scores = synthetic_head_scores(model)
    cache = ckv.CompressedCache.for_model(model, method, budget, window=WINDOW, head_scores=scores)
    inspector = CacheInspector(cache)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        cache=cache,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        streamer=inspector,
    )
    assert out.shape == (2, ids.shape[1] + NEW_TOKENS)
    assert inspector.ended and inspector.steps == NEW_TOKENS + 1  # the prompt, then each new token
    assert len(inspector.sizes) == NEW_TOKENS
    assert inspector.sizes == sorted(inspector.sizes)
    check_spare_capacity(cache)

    # the in-flight compression inside generate kept what a plain prefill keeps
    for a, b in zip(cache.keep_masks(), compressed_prompt.keep_masks(), strict=True):
        assert torch.equal(a, b)
    fed_back = NEW_TOKENS - 1  # the last generated token is never fed to the model
    layers = cache.compressed_layers
    assert all(layer.tail_len == fed_back for layer in layers)
    assert torch.equal(cache.kept_entries(), compressed_prompt.kept_entries() + fed_back)

    # growth: the generated tokens of every head, plus bounded spare capacity; not the context
    per_entry = entry_bytes(layers[0])
    segments = sum(layer.batch_size * layer.num_kv_heads for layer in layers)
    growth = cache.kv_bytes() - compressed_prompt.kv_bytes()
    generated = segments * fed_back * per_entry
    assert generated <= growth <= segments * (fed_back + 64) * per_entry
    full_growth = cache.kv_bytes_full() - compressed_prompt.kv_bytes_full()
    assert full_growth == generated
    if method != "full":
        assert cache.kv_bytes() < 0.75 * cache.kv_bytes_full()
    # the compressed prompt itself is untouched by decoding (settled: the tiers hold it again)
    for layer in layers:
        layer.storage.settle()
    prefix_bytes = sum(layer.storage.prefix.nbytes() for layer in layers if layer.holds_prompt)
    assert prefix_bytes == compressed_prompt.kv_bytes()


def test_tail_growth_is_geometric(device: torch.device) -> None:
    """Appending one token at a time reallocates O(log) times and never over-allocates."""
    layer = CompressedLayer(0)
    b, h, t, d = 1, 2, 10, 4
    keys = torch.randn(b, h, t, d, device=device)
    layer.set_prefix(keys, keys, torch.ones(b, h, t, dtype=torch.bool, device=device))
    reallocations, capacity = 0, 0
    for _ in range(2000):
        layer.append(torch.randn(b, h, 1, d, device=device), torch.randn(b, h, 1, d, device=device))
        if layer.tail_capacity() != capacity:
            reallocations, capacity = reallocations + 1, layer.tail_capacity()
        spare = layer.tail_capacity() - layer.tail_len
        assert spare <= max(0.125 * int(layer.kept_per_head().min()), 64)
    assert reallocations <= 25
