"""lm-eval's ``criticalkv`` model on a tiny random Llama saved as a folder, beside lm-eval's ``hf``
model on the same folder: the local fixture tasks (generate_until, multiple choice, rolling)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.lmeval_tasks import evaluate, responses, save_tiny, task_folder

TASKS = ["ckv_generate", "ckv_choice", "ckv_rolling"]
COMPRESSING = "method=snapkv,budget=0.4,window=8"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lmeval")
    return save_tiny(root / "tiny"), task_folder(root / "tasks")


@pytest.fixture(scope="module")
def hf(folders: tuple[Path, Path]) -> dict[str, Any]:
    model, tasks = folders
    return evaluate("hf", f"pretrained={model},dtype=float32", TASKS, tasks)


def _scores(results: dict[str, Any], task: str) -> list[list[tuple[float, bool]]]:
    return [[tuple(choice[0]) for choice in sample] for sample in responses(results, task)]


def _assert_scores_close(ours: dict[str, Any], theirs: dict[str, Any], task: str) -> None:
    for mine, other in zip(_scores(ours, task), _scores(theirs, task), strict=True):
        for (ll, greedy), (ll_ref, greedy_ref) in zip(mine, other, strict=True):
            assert ll == pytest.approx(ll_ref, abs=1e-4)
            assert greedy == greedy_ref


@pytest.mark.slow  # about 40 s here: three lm-eval runs of three tasks
def test_full_equals_lm_evals_hf_model(folders: tuple[Path, Path], hf: dict[str, Any]) -> None:
    model, tasks = folders
    ours = evaluate("criticalkv", f"pretrained={model},method=full", TASKS, tasks)
    assert responses(ours, "ckv_generate") == responses(hf, "ckv_generate")
    assert ours["results"]["ckv_generate"]["exact_match,none"] == hf["results"]["ckv_generate"]["exact_match,none"]
    _assert_scores_close(ours, hf, "ckv_choice")
    assert ours["results"]["ckv_choice"]["acc,none"] == hf["results"]["ckv_choice"]["acc,none"]
    for mine, other in zip(responses(ours, "ckv_rolling"), responses(hf, "ckv_rolling"), strict=True):
        assert mine[0][0] == pytest.approx(other[0][0], abs=1e-3)
    info = ours["config"]["criticalkv"]
    assert info["method"] == "full" and info["kv_ratio_mean"] == 1.0


@pytest.mark.slow  # about 40 s here
def test_a_compressing_method_holds_its_budget_and_batches_as_rows(
    folders: tuple[Path, Path], hf: dict[str, Any]
) -> None:
    model, tasks = folders
    one = evaluate("criticalkv", f"pretrained={model},{COMPRESSING}", TASKS, tasks)
    info = one["config"]["criticalkv"]
    assert info["method"] == "snapkv" and info["budget"] == 0.4
    assert 0 < info["kv_ratio_mean_compressed"] <= 0.4
    assert info["prompts_kept_whole"] > 0  # the rolling windows' one-token contexts
    # the generations differ from the full cache's on some prompt (the cache really is smaller)
    assert responses(one, "ckv_generate") != responses(hf, "ckv_generate")
    # loglikelihood_rolling scores windows whose context is one token: nothing to compress
    for mine, other in zip(responses(one, "ckv_rolling"), responses(hf, "ckv_rolling"), strict=True):
        assert mine[0][0] == pytest.approx(other[0][0], abs=1e-3)
    # padded batch rows answer as each prompt alone (padding is never kept)
    two = evaluate("criticalkv", f"pretrained={model},{COMPRESSING}", ["ckv_generate"], tasks, batch_size=3)
    assert responses(two, "ckv_generate") == responses(one, "ckv_generate")


def test_an_unknown_model_arg_lists_the_accepted_ones(folders: tuple[Path, Path]) -> None:
    from criticalkv.eval.lmeval import MODEL_ARGS, CriticalKVLM

    with pytest.raises(ValueError, match="does not take budgett; its model_args are pretrained, method") as error:
        CriticalKVLM(pretrained=str(folders[0]), budgett=0.2)
    assert all(name in str(error.value) for name in MODEL_ARGS)


def test_a_bad_cache_option_is_refused_before_the_model_loads() -> None:
    from criticalkv.eval.lmeval import LMEvalOptions

    with pytest.raises(ValueError, match="budget"):
        LMEvalOptions.parse(pretrained="no-such-folder", budget=1.5)
    with pytest.raises(ValueError, match="batch_size"):
        LMEvalOptions.parse(batch_size="many")


def test_sampling_is_refused_with_the_fix(folders: tuple[Path, Path]) -> None:
    model, tasks = folders
    with pytest.raises(ValueError, match=r"decodes greedily.*temperature=0"):
        evaluate(
            "criticalkv",
            f"pretrained={model},method=full",
            ["ckv_generate"],
            tasks,
            gen_kwargs="do_sample=True,temperature=0.7",
        )
