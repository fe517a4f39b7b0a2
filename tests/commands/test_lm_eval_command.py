"""``criticalkv lm-eval``: lm-eval's command line with the criticalkv model registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.cli import main
from tests.helpers.lmeval_tasks import save_tiny, task_folder


@pytest.mark.slow  # an lm-eval run with its task loading: about a minute on a busy machine
def test_lm_eval_runs_the_criticalkv_model_and_records_its_cache(tmp_path: Path) -> None:
    model, tasks = save_tiny(tmp_path / "tiny"), task_folder(tmp_path / "tasks")
    out = tmp_path / "out"
    code = main(
        [
            *(
                "lm-eval",
                "--model",
                "criticalkv",
                "--model_args",
                f"pretrained={model},method=snapkv,budget=0.4,window=8",
            ),
            *("--tasks", "ckv_choice", "--include_path", str(tasks), "--device", "cpu", "--limit", "2"),
            *("--output_path", str(out)),
        ]
    )
    assert code == 0
    (results,) = out.glob("*/results_*.json")
    info = json.loads(results.read_text())["config"]["criticalkv"]
    assert (info["method"], info["budget"], info["window"]) == ("snapkv", 0.4, 8)
    assert 0 < info["kv_ratio_mean_compressed"] <= 0.4


def test_lm_eval_help_is_lm_evals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lm-eval", "--help"]) == 0
    assert "--model" in capsys.readouterr().out
