"""Our methods against NVIDIA kvpress's presses on the same inputs (the ``[bench]`` extra; skipped
where kvpress is not importable: kvpress 0.5.5 pins transformers < 5.3, so ``make test-kvpress``
runs this file in a second environment).

Each test captures every layer's prefill state of a tiny random Llama (one unpadded row), hands
the same queries, keys, values and hidden states to kvpress's press and to our method, and compares
the kept entries. kvpress's *own* compression decides what it keeps: ``ScorerPress.compress``
returns the kept keys, which are matched back to their positions; the AdaKV presses leave the cache
whole and record the evicted ``(batch, head, position)`` triples on the module. Where the
definitions agree, the kept entries are equal; where we differ on purpose (docs/methods.md,
"Checked against kvpress"), the test asserts the documented difference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import criticalkv as ckv
from criticalkv.bench.kvpress_impl import import_kvpress
from tests.conftest import make_tiny, padded_batch

KVPRESS = import_kvpress()
pytestmark = pytest.mark.skipif(KVPRESS is None, reason="kvpress is not installed (make test-kvpress)")

LENGTH, WINDOW, RATIO = 80, 4, 0.7  # kvpress keeps int(80 * 0.3) = 24 entries per head

Layer = tuple[ckv.LayerState, Any, torch.Tensor, dict[str, Any]]


@torch.no_grad()
def _layers(arch: str = "llama", length: int = LENGTH, window: int = WINDOW) -> list[Layer]:
    """Per layer: our captured state, the attention module, and what kvpress's hook would receive
    (the hidden states entering the attention and the forward's keyword arguments)."""
    model = make_tiny(arch)
    if arch == "qwen2":  # a query bias that matters (transformers initialises it to zero)
        torch.manual_seed(5)
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.bias, std=0.5)
    ids, mask = padded_batch([length], seed=3)
    inputs: list[tuple[torch.Tensor, dict[str, Any]]] = []
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda _m, args, kw: inputs.append((kw["hidden_states"], kw)), with_kwargs=True
        )
        for layer in model.model.layers
    ]
    try:
        states, _ = ckv.runtime.capture_prefill(model, ids, mask, window=window, num_queries="all")  # type: ignore[arg-type]
    finally:
        for hook in hooks:
            hook.remove()
    for layer in model.model.layers:  # what kvpress's context manager sets before it hooks a layer
        layer.self_attn.rotary_emb = model.model.rotary_emb
    return [
        (state, layer.self_attn, hidden, kwargs)
        for state, layer, (hidden, kwargs) in zip(states, model.model.layers, inputs, strict=True)
    ]


def _kept_positions(keys: torch.Tensor, kept_keys: torch.Tensor) -> torch.Tensor:
    """(B, H, T) bool: which of ``keys`` (B, H, T, d) appear among ``kept_keys`` (B, H, n, d)."""
    same = (keys[:, :, :, None, :] == kept_keys[:, :, None, :, :]).all(-1)
    assert bool((same.sum(2) == 1).all()), "every kept key matches exactly one position"
    return same.any(-1)


@torch.no_grad()
def kvpress_kept(press: Any, layer: Layer) -> torch.Tensor:
    """(B, H_kv, T) bool: the entries kvpress's own ``compress`` keeps for this layer."""
    state, module, hidden, kwargs = layer
    module.masked_key_indices = None
    keys, values = state.keys.clone(), state.values.clone()
    kept_keys, _ = press.compress(module, hidden, keys, values, None, kwargs)
    masked = module.masked_key_indices
    if masked is None:  # a scorer press: the cache shrank to the kept entries
        return _kept_positions(state.keys, kept_keys)
    kept = torch.ones(state.keys.shape[:3], dtype=torch.bool)  # AdaKV: the cache is whole, entries masked
    kept[masked] = False
    module.masked_key_indices = None
    return kept


def _n_kept() -> int:
    return int(KVPRESS.utils.compute_n_kept(LENGTH, RATIO))


#: the same kept entries: our method -> kvpress's press (compression ratio, window)
SAME = {
    "snapkv": lambda kp: kp.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW),
    "adakv": lambda kp: kp.AdaKVPress(kp.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW)),
    "critical-snapkv": lambda kp: kp.CriticalKVPress(kp.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW)),
    "critical-adakv": lambda kp: kp.CriticalAdaKVPress(kp.SnapKVPress(compression_ratio=RATIO, window_size=WINDOW)),
    "streamingllm": lambda kp: kp.StreamingLLMPress(compression_ratio=RATIO),
}


@pytest.mark.parametrize("name", sorted(SAME))
def test_same_kept_entries_as_kvpress(name: str) -> None:
    """Uniform and AdaKV budgets, the window kept by both: every layer keeps the same entries.
    The Critical selections compare with float32 value norms (``precision="exact"``), as kvpress
    computes them in the model's dtype (float32 here)."""
    press = SAME[name](KVPRESS)
    method = ckv.get_method(name).with_norm_precision("exact")
    budget = torch.tensor([_n_kept()])
    for layer in _layers():
        kept = method.keep_mask(layer[0], budget)
        assert int(kept.sum()) == layer[0].num_kv_heads * _n_kept()
        assert torch.equal(kept, kvpress_kept(press, layer)), f"layer {layer[0].layer_idx}"


def assert_same_up_to_ties(ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor) -> None:
    """The same kept entries, except that entries tied at the budget's boundary may be swapped (top-k
    breaks ties its own way; Knorm ties a repeated token's keys, RoPE keeping the norm)."""
    assert torch.equal(ours.sum(-1), theirs.sum(-1))
    for b, h in (ours ^ theirs).any(-1).nonzero().tolist():
        tied = scores[b, h][ours[b, h] ^ theirs[b, h]]
        assert bool((tied == tied[0]).all()), f"row {b} head {h}: different entries, not ties"


def keep_window(press: Any, window: int = WINDOW) -> Any:
    """``press`` whose scores give the last ``window`` entries kvpress's "always keep" score
    (``max + 1``, as its SnapKV gives its window): what our methods do with the window."""

    class KeepWindow(KVPRESS.ScorerPress):  # type: ignore[misc, name-defined]
        def score(self, module: Any, hidden: Any, keys: Any, values: Any, attentions: Any, kwargs: Any) -> Any:
            scores = press.score(module, hidden, keys, values, attentions, kwargs)
            scores[..., -window:] = scores.max().item() + 1
            return scores

    return KeepWindow(compression_ratio=press.compression_ratio)


#: kept entries that differ only because our methods always keep the observation window and these
#: kvpress presses do not (TOVA forces the last token, Expected Attention the 4 sinks, KeyDiff and
#: Knorm nothing): our method -> kvpress's press
WINDOW_ONLY = {
    "tova": lambda kp: kp.TOVAPress(compression_ratio=RATIO),
    "keydiff": lambda kp: kp.KeyDiffPress(compression_ratio=RATIO),
    "knorm": lambda kp: kp.KnormPress(compression_ratio=RATIO),
    "expected-attention": lambda kp: kp.ExpectedAttentionPress(compression_ratio=RATIO),
}
CRITICAL_OF = {  # the Critical variants over the same scores (Expected Attention without ||v||_2, as ours)
    "critical-tova": lambda kp: kp.TOVAPress(compression_ratio=RATIO),
    "critical-expected-attention": lambda kp: kp.ExpectedAttentionPress(compression_ratio=RATIO, use_vnorm=False),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", sorted(WINDOW_ONLY))
def test_kept_entries_differ_from_kvpress_by_the_window_only(name: str, arch: str) -> None:
    """Ours keeps the window and kvpress's press need not, so ours swaps some of kvpress's lowest kept
    entries for window entries; with the window forced into kvpress's scores the two keep the same.
    On Qwen2 with a nonzero query bias Expected Attention agrees too: kvpress's ``q_proj`` applies it."""
    method = ckv.get_method(name)
    n = _n_kept()
    swapped = 0
    for layer in _layers(arch):
        state = layer[0]
        ours = method.keep_mask(state, torch.tensor([n]))
        theirs = kvpress_kept(WINDOW_ONLY[name](KVPRESS), layer)
        window = state.window_mask.expand_as(ours)
        assert bool(ours[window].all())
        assert not bool((ours & ~theirs & ~window).any()), "ours adds nothing but window entries"
        swapped += int((ours & ~theirs).sum())
        forced = kvpress_kept(keep_window(WINDOW_ONLY[name](KVPRESS)), layer)
        assert_same_up_to_ties(ours, forced, method.scores(state).float())
    assert swapped > 0, "on these inputs the window changes what kvpress keeps (the difference is real)"


@pytest.mark.parametrize("name", sorted(CRITICAL_OF))
def test_critical_variants_match_kvpress_with_the_window_kept(name: str) -> None:
    """kvpress's ``CriticalKVPress`` over the same base scores, with the window forced as ours forces it."""
    method = ckv.get_method(name).with_norm_precision("exact")
    n = _n_kept()
    for layer in _layers():
        press = KVPRESS.CriticalKVPress(keep_window(CRITICAL_OF[name](KVPRESS)))
        assert torch.equal(method.keep_mask(layer[0], torch.tensor([n])), kvpress_kept(press, layer))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("name", sorted(WINDOW_ONLY))
@torch.no_grad()
def test_same_scores_as_kvpress(name: str, arch: str) -> None:
    """kvpress's ``score`` equals ours outside the entries one side forces (kvpress's last token for
    TOVA, the 4 sinks for Expected Attention: kvpress gives them the batch's maximum, ours the head's)."""
    method = ckv.get_method(name)
    assert method.scores is not None
    first = 4 if name == "expected-attention" else 0
    for state, module, hidden, kwargs in _layers(arch):
        theirs = WINDOW_ONLY[name](KVPRESS).score(module, hidden, state.keys, state.values, None, kwargs).float()
        ours = method.scores(state).float()
        t = state.seq_len
        torch.testing.assert_close(ours[..., first : t - 1], theirs[..., first : t - 1], rtol=1e-4, atol=1e-6)


def _kvpress_pyramid_budgets(length: int, kept: int, window: int, layers: int, beta: int = 20) -> list[int]:
    """kvpress 0.5.5's ``PyramidKVPress.get_layer_budget`` written out: the pyramid over the kept count
    *including* the window, each layer rounded on its own, SnapKV's uniform count when the last
    layer's share would fall below the window."""
    low = kept / beta
    high = 2 * kept - low
    if high >= length - window:
        high = length - window
        low = 2 * kept - high
    if not length >= high >= low >= window:
        return [kept] * layers
    return [round(high - i * (high - low) / (layers - 1)) for i in range(layers)]


@pytest.mark.parametrize(("length", "ratio"), [(LENGTH, RATIO), (400, 0.5)])
def test_pyramidkv_differs_from_kvpress_in_the_layer_budgets_only(length: int, ratio: float) -> None:
    """Same scores and top-k within a layer; the layer budgets differ: ours puts the pyramid on the
    entries outside the window (PyramidKV's code) and rounds so the layers sum to exactly L x b;
    kvpress's includes the window and falls back to uniform budgets for small ones (80 tokens here)."""
    kept = int(KVPRESS.utils.compute_n_kept(length, ratio))
    layers = _layers(length=length)
    press = KVPRESS.PyramidKVPress(compression_ratio=ratio, window_size=WINDOW)
    masks = ckv.get_method("pyramidkv").keep_masks([layer[0] for layer in layers], torch.tensor([kept]))
    ours = [m.sum(-1) for m in masks]
    theirs = [kvpress_kept(press, layer) for layer in layers]
    per_head = [int(t.sum(-1).flatten()[0]) for t in theirs]
    assert per_head == _kvpress_pyramid_budgets(length, kept, WINDOW, len(layers))
    assert sum(int(o.sum()) for o in ours) == len(layers) * layers[0][0].num_kv_heads * kept
    assert [int(o.flatten()[0]) for o in ours] != per_head
    snapkv = ckv.get_method("snapkv")
    for layer, their in zip(layers, theirs, strict=True):  # with kvpress's layer budget, SnapKV's entries
        assert torch.equal(snapkv.keep_mask(layer[0], their.sum(-1).flatten()[:1]), their)
