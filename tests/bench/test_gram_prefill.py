"""benchmarks/gram_prefill.py: its stage-2 split of a Critical selection and its overlap table."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import criticalkv as ckv
from criticalkv.select.topk import topk_mask
from tests.helpers.random_state import random_state


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gram_prefill.py"
    spec = importlib.util.spec_from_file_location("gram_prefill_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gram_prefill = _load()


@pytest.mark.parametrize(("name", "seed"), [("critical-snapkv", 0), ("critical-adakv", 1), ("critical-adakv", 2)])
def test_stage2_is_the_kept_set_minus_the_window_and_stage1(name: str, seed: int) -> None:
    state = random_state(seed, lengths=[40, 33], num_kv_heads=2, group=2, head_dim=8, window=4)
    budget = torch.tensor([14, 14])
    method = ckv.get_method(name, p=2, gram=True, precision="exact")
    keep = method.keep_mask(state, budget)
    stage2 = gram_prefill._stage2(method, state, budget, keep)
    scores = method.ranked_scores(state, budget)
    budgets = method.budgets(scores, state, budget)
    k1 = (budgets // 2 - state.window).clamp_min(0)  # alpha = 0.5
    stage1 = topk_mask(scores, k1, state.eligible)
    assert not (stage2 & (stage1 | state.window_mask)).any()
    assert torch.equal(stage2 | stage1 | (keep & state.window_mask), keep)
    assert torch.equal(stage2.sum(-1), budgets - state.window - k1)


def test_overlap_table_gives_mean_and_min_over_prompts_and_heads() -> None:
    def row(layer: int, overlap: list[float], jaccard: list[float], stage2: list[float]) -> dict[str, object]:
        found = {"overlap": overlap, "jaccard": jaccard, "stage2_overlap": stage2}
        return {"length": 64, "base": "adakv", "layer": layer, **found}

    rows = [row(0, [1.0, 0.5], [1.0, 0.25], [1.0, 0.0]), row(0, [0.75, 1.0], [0.5, 1.0], [0.5, 1.0])]
    rows.append(row(1, [1.0], [1.0], [1.0]))
    lines = gram_prefill.overlap_table(rows).splitlines()
    assert lines[1] == "64 | adakv | 0 | 0.8125 | 0.5000 | 0.6875 | 0.2500 | 0.6250 | 0.0000"
    assert lines[2] == "64 | adakv | 1 | 1.0000 | 1.0000 | 1.0000 | 1.0000 | 1.0000 | 1.0000"
