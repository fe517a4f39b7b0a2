"""StreamingLLM, Knorm and H2O against direct loop-based readings of their papers, and the
``needs.queries`` hand-off that gives H2O every prompt query."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import criticalkv as ckv
from criticalkv.cli import main
from criticalkv.needs import Needs
from criticalkv.prompts import positions
from criticalkv.scores import AccumulatedAttention, Scorer, WindowAttention
from criticalkv.state import LayerState
from tests.conftest import make_tiny, padded_batch
from tests.helpers.random_state import random_state, with_all_queries

# (seed, lengths, H_kv, G, head_dim, window, budget)
CASES = [
    (0, [40], 2, 3, 8, 4, 0.3),
    (1, [33, 40, 21], 2, 2, 4, 3, 0.5),
    (2, [48, 30], 3, 1, 8, 6, 12),
    (3, [25, 25], 1, 4, 4, 2, 7),  # budget 7 = window 2 + 4 sinks + 1 recent
    (4, [17, 36], 4, 2, 4, 5, 6),  # fewer selectable entries than sinks
]


def make_state(case: tuple, all_queries: bool = False) -> tuple[LayerState, torch.Tensor]:
    seed, lengths, h_kv, group, d, window, budget = case
    state = random_state(seed, lengths=lengths, num_kv_heads=h_kv, group=group, head_dim=d, window=window)
    if all_queries:
        state = with_all_queries(state, seed)
    return state, ckv.resolve_budget(budget, state.lengths, window)


def real_positions(state: LayerState, row: int) -> list[int]:
    return [i for i in range(state.seq_len) if bool(state.valid[row, i])]


def as_mask(state: LayerState, kept: dict[tuple[int, int], set[int]]) -> torch.Tensor:
    mask = torch.zeros(state.batch_size, state.num_kv_heads, state.seq_len, dtype=torch.bool)
    for (row, head), cols in kept.items():
        mask[row, head, sorted(cols)] = True
    return mask


# --- StreamingLLM --------------------------------------------------------------------------------


def naive_streaming(state: LayerState, budget: torch.Tensor, sinks: int = 4) -> torch.Tensor:
    """Window + the first ``sinks`` real tokens + the most recent ones, per row (all heads alike)."""
    kept = {}
    w = state.window
    for row in range(state.batch_size):
        real = real_positions(state, row)
        before = real[: len(real) - w]
        room = int(budget[row]) - w
        sink = before[: min(sinks, room)]
        rest = [i for i in before if i not in sink]
        recent = rest[len(rest) - (room - len(sink)) :] if room > len(sink) else []
        for head in range(state.num_kv_heads):
            kept[(row, head)] = {*sink, *recent, *real[len(real) - w :]}
    return as_mask(state, kept)


@pytest.mark.parametrize("case", CASES)
def test_streamingllm_keeps_sinks_and_recent_tokens(case: tuple) -> None:
    state, tokens = make_state(case)
    keep = ckv.get_method("streamingllm").keep_mask(state, tokens)
    assert torch.equal(keep, naive_streaming(state, tokens))


# --- Knorm ---------------------------------------------------------------------------------------


def naive_knorm(state: LayerState, budget: torch.Tensor) -> torch.Tensor:
    """Per head: the window plus the ``b - w`` eligible keys of lowest L2 norm."""
    kept = {}
    w = state.window
    for row in range(state.batch_size):
        real = real_positions(state, row)
        for head in range(state.num_kv_heads):
            norms = {i: float(state.keys[row, head, i].double().norm()) for i in real[: len(real) - w]}
            lowest = sorted(norms, key=lambda i: norms[i])[: int(budget[row]) - w]
            kept[(row, head)] = {*lowest, *real[len(real) - w :]}
    return as_mask(state, kept)


@pytest.mark.parametrize("case", CASES)
def test_knorm_keeps_the_lowest_key_norms(case: tuple) -> None:
    state, tokens = make_state(case)
    keep = ckv.get_method("knorm").keep_mask(state, tokens)
    assert torch.equal(keep, naive_knorm(state, tokens))


# --- H2O -----------------------------------------------------------------------------------------


def naive_accumulated_attention(state: LayerState) -> torch.Tensor:
    """(B, H_kv, T) float64: per real query, softmax over the real keys it sees, summed; group mean."""
    b, h_kv, t, _ = state.keys.shape
    g = state.group_size
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for row in range(b):
        real = real_positions(state, row)
        for hq in range(h_kv * g):
            kv = hq // g
            for i in real:
                seen = [j for j in real if j <= i]
                logits = torch.stack(
                    [state.queries[row, hq, i].double() @ state.keys[row, kv, j].double() for j in seen]
                )
                for j, a in zip(seen, torch.softmax(logits * state.scaling, dim=0).tolist(), strict=True):
                    out[row, kv, j] += a / g
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_queries", [None, 1, 5])
def test_h2o_scores_match_the_naive_sum(case: tuple, chunk_queries: int | None) -> None:
    state, _ = make_state(case, all_queries=True)
    kwargs = {}
    if chunk_queries is not None:  # the float32 (B, H_q, chunk, T) temporary holds this many queries
        kwargs["max_chunk_bytes"] = chunk_queries * state.batch_size * state.num_query_heads * state.seq_len * 4
    ours = AccumulatedAttention(**kwargs)(state).double()
    ref = naive_accumulated_attention(state)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-5)
    # each real query spreads a total weight of one
    assert torch.allclose(ours.sum(-1), state.lengths[:, None].double().expand_as(ours.sum(-1)), atol=1e-3)


@pytest.mark.parametrize("case", CASES)
def test_h2o_keeps_the_heavy_hitters(case: tuple) -> None:
    state, tokens = make_state(case, all_queries=True)
    keep = ckv.get_method("h2o").keep_mask(state, tokens)
    ref = naive_accumulated_attention(state)
    w = state.window
    kept = {}
    for row in range(state.batch_size):
        real = real_positions(state, row)
        for head in range(state.num_kv_heads):
            scores = ref[row, head].tolist()
            heavy = sorted(real[: len(real) - w], key=lambda i: -scores[i])[: int(tokens[row]) - w]
            kept[(row, head)] = {*heavy, *real[len(real) - w :]}
    assert torch.equal(keep, as_mask(state, kept))


def test_h2o_refuses_a_state_without_every_query() -> None:
    state, tokens = make_state(CASES[0])  # only the window's queries
    with pytest.raises(ValueError, match=r"holds only the last 4 of 40.*num_queries='all'"):
        ckv.get_method("h2o").keep_mask(state, tokens)


# --- the needs.queries hand-off -----------------------------------------------------------------


@dataclass(frozen=True)
class RecordingScores(Scorer):
    """Window attention that notes how many queries each layer state held."""

    queries: int | str | None
    seen: list[int]

    @property  # type: ignore[misc]
    def needs(self) -> Needs:  # type: ignore[override]
        return Needs(queries=self.queries)  # type: ignore[arg-type]

    def __call__(self, state: LayerState) -> torch.Tensor:
        self.seen.append(int(state.queries.shape[2]))
        return WindowAttention()(state)


@pytest.mark.parametrize(("needed", "expected"), [(None, 5), (3, 5), (12, 12), ("all", 50)])
@torch.no_grad()
def test_caches_hand_scores_the_queries_they_need(needed: int | str | None, expected: int) -> None:
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([50, 44], seed=4)
    seen: list[int] = []
    method = ckv.Method("recording", "-", "-", RecordingScores(needed, seen))
    cache = ckv.CompressedCache.for_model(model, method, 0.3, window=5)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    assert seen == [expected] * 3
    capture = ckv.CaptureCache(3, window=5, num_queries=needed)  # type: ignore[arg-type]
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=capture)
    assert [int(s.queries.shape[2]) for s in capture.states()] == [expected] * 3


@torch.no_grad()
def test_h2o_from_captured_states_equals_inflight() -> None:
    model = ckv.attach(make_tiny("qwen2"))
    ids, mask = padded_batch([50, 44], seed=4)
    inflight = ckv.CompressedCache.for_model(model, "h2o", 0.25, window=5)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=inflight)
    capture = ckv.CaptureCache(3, window=5, num_queries="all")
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=capture)
    derived = ckv.CompressedCache.from_states(capture.states(), "h2o", 0.25)
    for a, b in zip(inflight.keep_masks(), derived.keep_masks(), strict=True):
        assert torch.equal(a, b)
    window_only = ckv.CaptureCache(3, window=5)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=window_only)
    with pytest.raises(ValueError, match="num_queries='all'"):
        ckv.CompressedCache.from_states(window_only.states(), "h2o", 0.25)


def test_bad_num_queries() -> None:
    with pytest.raises(ValueError, match="positive integer, 'all' or None"):
        ckv.CaptureCache(3, window=5, num_queries=0)
    with pytest.raises(ValueError, match="positive integer, 'all' or None"):
        ckv.CaptureCache(3, window=5, num_queries="most")  # type: ignore[arg-type]


def test_methods_command_lists_the_baselines_with_references(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()}
    expected = {
        "pyramidkv": "2406.02069",
        "critical-pyramidkv": "2502.03805",
        "headkv": "2410.19258",
        "critical-headkv": "2502.03805",
        "streamingllm": "2309.17453",
        "h2o": "2306.14048",
        "knorm": "2406.11430",
    }
    for name, arxiv in expected.items():
        assert arxiv in lines[name], lines[name]
