"""The precision of the projected value norms: ``exact``, ``auto`` (bfloat16 where native), explicit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import criticalkv as ckv
from criticalkv.budgets.resolve import resolve_budget
from criticalkv.scores import value_norms
from criticalkv.scores.value_norms import norm_dtype, projected_value_norms
from criticalkv.select.critical import Critical
from tests.helpers.random_state import o_proj_weight, random_state


def test_norm_dtype_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    fp32, bf16, fp16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float16)
    assert norm_dtype("exact", fp32) is torch.float32
    assert norm_dtype("exact", fp16) is torch.float16
    assert norm_dtype("auto", bf16) is torch.bfloat16
    assert norm_dtype("auto", fp16) is torch.float16
    assert norm_dtype("float32", bf16) is torch.float32
    assert norm_dtype("bfloat16", fp32) is torch.bfloat16
    monkeypatch.setattr(value_norms, "native_cpu_bf16", lambda: True)
    assert norm_dtype("auto", fp32) is torch.bfloat16
    monkeypatch.setattr(value_norms, "native_cpu_bf16", lambda: False)
    assert norm_dtype("auto", fp32) is torch.float32


@pytest.mark.parametrize("bad", ["half", "", "FLOAT32"])
def test_unknown_precision_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="precision"):
        norm_dtype(bad, torch.zeros(1))
    with pytest.raises(ValueError, match="precision"):
        Critical(precision=bad)


@pytest.mark.parametrize("p", [1, 2])
def test_bfloat16_norms_are_close_to_exact(p: int) -> None:
    state = random_state(3, lengths=[200, 150], num_kv_heads=2, group=3, head_dim=16, window=4, hidden=24)
    weight = o_proj_weight(state)
    exact = projected_value_norms(state.values, weight, p=p)
    approx = projected_value_norms(state.values, weight, p=p, precision="bfloat16")
    assert approx.dtype == torch.float32
    assert ((approx - exact).abs() / exact.clamp_min(1e-6)).max() < 2e-2
    assert not torch.equal(approx, exact)  # it really ran in bfloat16


@pytest.mark.parametrize("name", ["critical-snapkv", "critical-adakv"])
def test_bfloat16_selection_keeps_almost_the_same_entries(name: str) -> None:
    state = random_state(5, lengths=[512, 400], num_kv_heads=2, group=3, head_dim=16, window=8, hidden=48)
    tokens = resolve_budget(0.2, state.lengths, state.window)
    method = ckv.get_method(name)
    keep = {
        precision: dataclasses.replace(method, select=Critical(precision=precision)).keep_mask(state, tokens)
        for precision in ("exact", "bfloat16")
    }
    assert torch.equal(keep["exact"].sum(-1), keep["bfloat16"].sum(-1))  # same budgets either way
    shared = (keep["exact"] & keep["bfloat16"]).sum() / keep["exact"].sum()
    assert shared > 0.97


def test_precision_is_part_of_the_memo_key() -> None:
    state = random_state(7, lengths=[64], num_kv_heads=1, group=2, head_dim=8, window=4)
    exact = Critical(precision="exact").norms(state)
    approx = Critical(precision="bfloat16").norms(state)
    assert not torch.equal(exact, approx)
    assert torch.equal(Critical(precision="exact").norms(state), exact)
