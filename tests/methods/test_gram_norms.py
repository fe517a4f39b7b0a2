"""The Gram-form L2 criterion equals the direct L2 projection ``||v W_O^h||_2``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import criticalkv as ckv
from criticalkv.cli import main
from criticalkv.eval import results as sweep_results
from criticalkv.scores.value_norms import gram_value_norms, projected_value_norms
from criticalkv.select.critical import Critical
from tests.helpers.random_state import o_proj_weight, random_state


def _loop_l2(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """||v W_O^h||_2 per query head from its definition (float64), GQA group mean."""
    b, h_kv, t, d = values.shape
    g = weight.shape[1] // d // h_kv
    out = torch.zeros(b, h_kv, t, dtype=torch.float64)
    for kv in range(h_kv):
        for j in range(g):
            block = weight[:, (kv * g + j) * d : (kv * g + j + 1) * d].double().T  # W_O^h, (d, D)
            out[:, kv] += (values[:, kv].double() @ block).norm(dim=-1) / g
    return out


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    h_kv=st.integers(1, 3),
    group=st.integers(1, 3),
    d=st.sampled_from([2, 4, 8]),
    hidden=st.integers(3, 24),
)
def test_gram_norms_equal_the_direct_l2_projection(seed: int, h_kv: int, group: int, d: int, hidden: int) -> None:
    state = random_state(seed, lengths=[9, 6], num_kv_heads=h_kv, group=group, head_dim=d, window=2, hidden=hidden)
    weight = o_proj_weight(state)
    values = state.values.clamp(-5, 5)
    gram = gram_value_norms(values, weight)
    torch.testing.assert_close(gram.double(), _loop_l2(values, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gram, projected_value_norms(values, weight, p=2), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_critical_with_gram_keeps_what_the_direct_l2_keeps(seed: int) -> None:
    state = random_state(seed, lengths=[40, 31], num_kv_heads=2, group=3, head_dim=8, window=4)
    tokens = torch.tensor([12, 12])
    direct = ckv.get_method("critical-snapkv", p=2, precision="exact")
    gram = ckv.get_method("critical-snapkv", p=2, gram=True, precision="exact")
    assert torch.equal(direct.keep_mask(state, tokens), gram.keep_mask(state, tokens))


def test_gram_needs_the_l2_norm() -> None:
    with pytest.raises(ValueError, match="p=2"):
        Critical(gram=True)


def test_eval_runs_the_gram_spec_and_matches_the_direct_l2(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``criticalkv eval --methods critical-adakv:p=2:gram=true`` end to end: recorded under its
    canonical name, with the fidelity of the direct L2 projection (the same entries are kept)."""
    out = tmp_path / "run"
    methods = "critical-adakv,critical-adakv:p=2:precision=exact,critical-adakv:p=2:gram=true:precision=exact"
    args = ["eval", "--model", str(tiny_folder), "--tasks", "niah_single_1", "--lengths", "400", "--samples", "2"]
    args += ["--methods", methods, "--budgets", "0.3", "--window", "6", "--max-new-tokens", "4", "--out", str(out)]
    assert main(args) == 0
    records = sweep_results.read_results(out)
    gram_name, direct_name = "critical-adakv:gram=true:p=2:precision=exact", "critical-adakv:p=2:precision=exact"
    assert {r["method"] for r in records} == {"critical-adakv", direct_name, gram_name}
    by_method: dict[str, list[dict[str, object]]] = {}
    for record in sorted(records, key=lambda r: r["index"]):
        by_method.setdefault(record["method"], []).append(record)
    assert len(by_method[gram_name]) == 2
    for gram, direct in zip(by_method[gram_name], by_method[direct_name], strict=True):
        assert gram["kv_bytes"] == direct["kv_bytes"]
        assert gram["prediction"] == direct["prediction"]
        assert gram["nll"] == pytest.approx(direct["nll"], rel=1e-4, abs=1e-5)


def test_eval_refuses_gram_without_the_l2_norm(tiny_folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["eval", "--model", str(tiny_folder), "--tasks", "niah_single_1", "--lengths", "400"]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--methods", "critical-adakv:gram=true"])
    assert exit_info.value.code == 2
    assert "pass p=2" in capsys.readouterr().err


def test_value_norms_build_no_autograd_graph() -> None:
    """A model's ``o_proj`` weight requires grad; the norms must not keep a graph through it (it
    would hold every projected chunk of every layer while the states live)."""
    state = random_state(0, lengths=[12], num_kv_heads=2, group=2, head_dim=4, window=2)
    weight = o_proj_weight(state).clone().requires_grad_(True)
    for norms in (
        projected_value_norms(state.values, weight, p=1),
        projected_value_norms(state.values, weight, p=2),
        gram_value_norms(state.values, weight),
    ):
        assert not norms.requires_grad and norms.grad_fn is None
