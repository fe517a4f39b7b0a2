"""Results folders written before the benchmark registry and the shared run store still resume.

The RULER folders in ``docs/results/ruler-default/`` hold ``run.json`` and ``results.jsonl``
written by the earlier code: their recorded configs must rebuild the same identity and flat
config, open for resume unchanged, count as fully done, and (slow) recompute the same records.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from criticalkv.analysis.results_log import ResultsLog, check_run_config, read_run_config
from criticalkv.eval import results as sweep_results
from criticalkv.eval.benchmarks import FLAT_DEFAULTS
from criticalkv.eval.sweep import SweepConfig, runner
from criticalkv.methods import available_methods

#: the folders written by the earlier code (later ones, such as the resumable ``aware-20`` sweep, are
#: checked by the current code's own tests)
EARLIER = ("agnostic", "aware", "aware-all-methods", "aware-defensive-ablation")
RESULTS_ROOT = Path(__file__).resolve().parents[2] / "docs/results/ruler-default"
RULER_FOLDERS = [RESULTS_ROOT / name / "run.json" for name in EARLIER if (RESULTS_ROOT / name / "run.json").is_file()]
TIMINGS = {"prefill_s", "compress_s", "batch_decode_s", "batch_rows"}


def _recorded(run_json: Path, run: int = -1) -> tuple[dict[str, Any], dict[str, Any]]:
    data = json.loads(run_json.read_text())
    return data["identity"], data["runs"][run]["config"]


def _registered(recorded: dict[str, Any]) -> dict[str, Any]:
    """``recorded`` without the methods a folder's own script registered (not part of the identity)."""
    return {**recorded, "methods": [m for m in recorded["methods"] if m in available_methods()]}


def _config(recorded: dict[str, Any], out: Path, **changes: Any) -> SweepConfig:
    flat = {k: v for k, v in _registered(recorded).items() if k not in ("out", "ray")}
    return SweepConfig(out=out, **{**flat, **changes})


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    out.mkdir()
    for name in (sweep_results.RUN, sweep_results.RESULTS):
        shutil.copy(folder / name, out / name)
    return out


def test_the_committed_folders_are_found() -> None:
    assert len(RULER_FOLDERS) == 4


@pytest.mark.parametrize("run_json", RULER_FOLDERS, ids=lambda p: p.parent.name)
def test_recorded_configs_rebuild_the_same_identity_and_config(run_json: Path) -> None:
    identity, _ = _recorded(run_json)
    for index in range(len(json.loads(run_json.read_text())["runs"])):
        _, recorded = _recorded(run_json, index)
        config = _config(recorded, Path(recorded["out"]))
        assert list(config.identity().items()) == list(identity.items())  # same keys, order and values
        flat = config.to_json()
        assert {k: flat[k] for k in recorded} == _registered(recorded)
        assert {k: flat[k] for k in set(flat) - set(recorded)} == {
            k: FLAT_DEFAULTS[k] for k in set(flat) - set(recorded)
        }


@pytest.mark.parametrize("run_json", RULER_FOLDERS, ids=lambda p: p.parent.name)
def test_a_committed_folder_opens_for_resume_and_is_done(run_json: Path, tmp_path: Path) -> None:
    out = _copy(run_json.parent, tmp_path)
    before = json.loads((out / sweep_results.RUN).read_text())
    results = (out / sweep_results.RESULTS).read_bytes()
    config = _config(before["runs"][-1]["config"], out)
    sweep_results.open_run(out, config.identity(), config.to_json())
    after = json.loads((out / sweep_results.RUN).read_text())
    assert list(after) == ["identity", "runs"] and after["identity"] == before["identity"]
    assert after["runs"][:-1] == before["runs"] and after["runs"][-1]["config"] == config.to_json()
    done = set(sweep_results.iter_done(out))
    assert len(done) == len(results.splitlines())  # every line has its own key
    total, initial = runner.progress_counts(config, config.configs(), done)
    assert total == initial == len(config.bench.planned(config.draw) or []) * len(config.configs())  # nothing to run
    assert (out / sweep_results.RESULTS).read_bytes() == results


def test_a_committed_folder_refuses_another_identity(tmp_path: Path) -> None:
    out = _copy(RULER_FOLDERS[0].parent, tmp_path)
    _, recorded = _recorded(out / sweep_results.RUN)
    config = _config(recorded, out, window=16)
    with pytest.raises(ValueError, match=r"different configuration .*window: 64 there, 16 now"):
        sweep_results.open_run(out, config.identity(), config.to_json())


def test_an_analysis_folder_of_the_earlier_store_resumes(tmp_path: Path) -> None:
    spec = {"model": "default", "length": 2048, "window": 32, "seed": 0, "chat": True}
    old = {"spec": spec, "created": "2026-12-01T08:00:00", "commands": ["criticalkv perturbation"], "provenance": {}}
    (tmp_path / "config.json").write_text(json.dumps(old, indent=2) + "\n")
    row = {"sample": 0, "method": "snapkv", "base": None, "budget": 0.1}
    (tmp_path / "results.jsonl").write_text(json.dumps(row, separators=(",", ":")) + "\n")
    assert ResultsLog(tmp_path / "results.jsonl").done() == {(0, "snapkv", "0.1")}
    config = check_run_config(tmp_path, spec, "criticalkv perturbation --samples 2")
    assert config == read_run_config(tmp_path)
    assert list(config) == ["spec", "created", "commands", "provenance"]
    assert config["created"] == old["created"] and len(config["commands"]) == 2
    with pytest.raises(ValueError, match=r"other settings \(length: 2048 there, 1024 now\)"):
        check_run_config(tmp_path, {**spec, "length": 1024})


@pytest.mark.slow
def test_resuming_a_committed_folder_recomputes_the_same_records(tmp_path: Path) -> None:
    """Drop three records of one sample from a copy of ``aware``; a resume writes them again."""
    from criticalkv.models import load_model

    out = _copy(RULER_FOLDERS[0].parent.parent / "aware", tmp_path)
    _, recorded = _recorded(out / sweep_results.RUN)
    config = _config(recorded, out, tasks=["niah_single_1"], lengths=[1024], samples=1)
    config = _config(config.to_json(), out, methods=["full", "snapkv", "critical-snapkv"], budgets=[0.2])
    wanted = {f"niah_single_1|1024|0|{m}|{b}" for m, b in config.configs()}
    lines = (out / sweep_results.RESULTS).read_text().splitlines()
    kept = [line for line in lines if sweep_results.result_key(json.loads(line)) not in wanted]
    removed = [json.loads(line) for line in lines if sweep_results.result_key(json.loads(line)) in wanted]
    assert len(removed) == 3
    (out / sweep_results.RESULTS).write_text("\n".join(kept) + "\n")
    model, tokenizer = load_model("default", device="cpu")
    runner.run_sweep(config, model, tokenizer)
    again = {sweep_results.result_key(r): r for r in sweep_results.read_results(out)[len(kept) :]}
    assert set(again) == wanted
    for old in removed:
        new = again[sweep_results.result_key(old)]
        assert sorted(new) == sorted(old)
        for field in ("nll", "kl", "top1", "partial"):
            assert new[field] == pytest.approx(old[field], abs=1e-4), field
        same = set(old) - TIMINGS - {"nll", "kl", "top1", "partial"}
        assert {k: new[k] for k in same} == {k: old[k] for k in same}


@pytest.mark.parametrize(
    ("option", "value", "there"),
    [("norm_precision", "exact", "'exact'"), ("kv_bits", 8, "8"), ("decode_budget", 512, "512")],
)
def test_a_folder_made_with_an_optional_setting_never_resumes_without_it(
    tmp_path: Path, option: str, value: Any, there: str
) -> None:
    """An option recorded only when set is still compared when the new command omits it."""
    out = _copy(RULER_FOLDERS[0].parent, tmp_path)
    _, recorded = _recorded(out / sweep_results.RUN)
    recorded = {**recorded, "methods": ["full", "snapkv", "critical-snapkv"]}  # they all re-select
    with_option = _config(recorded, out, **{option: value})
    sweep_results.open_run(tmp_path / "fresh", with_option.identity(), with_option.to_json())
    first = (out / "results.jsonl").read_text().splitlines()[0]
    (tmp_path / "fresh" / "results.jsonl").write_text(first + "\n")  # a folder with results is protected
    plain = _config(recorded, tmp_path / "fresh")
    with pytest.raises(ValueError, match=rf"different configuration .*{option}: {there} there, None now"):
        sweep_results.open_run(tmp_path / "fresh", plain.identity(), plain.to_json())
    # and the other way round: a plain folder refuses the option
    with pytest.raises(ValueError, match=rf"{option}: None there, {there} now"):
        sweep_results.open_run(out, with_option.identity(), with_option.to_json())
