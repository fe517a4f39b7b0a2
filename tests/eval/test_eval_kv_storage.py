"""``criticalkv eval --kv-bits --kv-group-size --kv-residual``: the storage options reach every
compressed row, enter the sweep identity (the group in effect whenever kv_bits is set, the residual
when set), and bad values are refused with a sentence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from criticalkv.cache.quantized import KVQuantization
from criticalkv.cli import main
from criticalkv.eval import results as sweep_results
from criticalkv.eval.sweep import SweepConfig

COMMON = {"tasks": ["niah_single_1"], "lengths": [256], "samples": 1, "model": "tiny"}


def test_the_group_in_effect_and_a_given_residual_enter_the_identity(tmp_path: Path) -> None:
    four = SweepConfig(out=tmp_path / "a", kv_bits=4, **COMMON)  # type: ignore[arg-type]
    # the default group is recorded (defaults changed over time); the residual only when given
    assert four.identity()["kv_group_size"] == 64 and "kv_residual" not in four.identity()
    assert "kv_group_size" not in four.to_json() and "kv_residual" not in four.to_json()
    grouped = SweepConfig(out=tmp_path / "b", kv_bits=4, kv_group_size=8, kv_residual=4, **COMMON)  # type: ignore[arg-type]
    assert (grouped.identity()["kv_group_size"], grouped.identity()["kv_residual"]) == (8, 4)
    assert (grouped.to_json()["kv_group_size"], grouped.to_json()["kv_residual"]) == (8, 4)
    assert grouped.cache == {"kv_bits": 4, "kv_group_size": 8, "kv_residual": 4}
    assert grouped.spec().storage == KVQuantization(4, 8, 4)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv_group_size": 8}, "give kv_bits 8 or 4 too"),
        ({"kv_residual": 4}, "give kv_bits 8 or 4 too"),
        ({"kv_bits": 4, "kv_group_size": 0}, "group size .kv_group_size. must be a positive integer"),
        ({"kv_bits": 4, "kv_residual": -1}, "residual .kv_residual. must be a non-negative integer"),
    ],
)
def test_bad_storage_options_are_refused(tmp_path: Path, changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SweepConfig(out=tmp_path / "c", **COMMON, **changes)  # type: ignore[arg-type]


def _argv(tiny_folder: Path, out: Path, *extra: str) -> list[str]:
    argv = ["eval", "--model", str(tiny_folder), "--tasks", "niah_single_1", "--lengths", "400", "--samples", "1"]
    argv += ["--methods", "full,snapkv", "--budgets", "0.3", "--window", "8", "--max-new-tokens", "4"]
    return [*argv, "--out", str(out), *extra]


def test_eval_kv_group_size_on_a_tiny_model(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    # group 24 vs head_dim 16 (neither a divisor nor a multiple): refused before any work
    assert main(_argv(tiny_folder, out, "--kv-bits", "4", "--kv-group-size", "24")) == 2
    err = capsys.readouterr().err
    assert "--kv-group-size" in err and "does not divide the head dimension 16" in err
    assert not out.exists()
    assert main(_argv(tiny_folder, out, "--kv-bits", "4", "--kv-group-size", "8", "--kv-residual", "4")) == 0
    identity = json.loads((out / "run.json").read_text())["identity"]
    assert (identity["kv_bits"], identity["kv_group_size"], identity["kv_residual"]) == (4, 8, 4)
    records = sweep_results.read_results(out)
    assert {r["method"] for r in records} == {"full", "snapkv"}
    snap = next(r for r in records if r["method"] == "snapkv")
    assert (snap["kv_bits"], snap["kv_group_size"], snap["kv_residual"]) == (4, 8, 4)
    assert 0 < snap["kv_bytes"] < 0.3 * snap["kv_bytes_full"]  # evicted and quantized
    capsys.readouterr()
    # the same options resume (nothing left to do); another group size is another run, refused
    assert main(_argv(tiny_folder, out, "--kv-bits", "4", "--kv-group-size", "8", "--kv-residual", "4")) == 0
    assert len(sweep_results.read_results(out)) == len(records)
    assert main(_argv(tiny_folder, out, "--kv-bits", "4", "--kv-group-size", "4", "--kv-residual", "4")) == 2
    assert "kv_group_size: 8 there, 4 now" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-bits", "4", "--kv-group-size", "5"], "--kv-group-size) 5 does not divide the head dimension 16"),
        (["--kv-bits", "8", "--kv-group-size", "0"], "--kv-group-size) must be a positive integer"),
        (["--kv-group-size", "8"], "give --kv-bits 8 or 4 too"),
    ],
)
def test_eval_rejects_bad_storage_options(
    tiny_folder: Path, tmp_path: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_argv(tiny_folder, tmp_path / "bad", *extra)) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_eval_rejects_unsupported_bits(tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(_argv(tiny_folder, tmp_path / "bad", "--kv-bits", "3"))
    assert exit_.value.code == 2 and "invalid choice: 3" in capsys.readouterr().err


QUANTIZED_RUNS = Path(__file__).resolve().parents[2] / "docs/results/quantized-storage/defaults"


def test_a_recorded_quantized_config_rebuilds_its_run_json() -> None:
    """``SweepConfig(**recorded)`` (the flat keys ``run.json`` records, ``kv_group_size`` among them)
    rebuilds the committed folder's identity and config, keys, order and values (the folders beside
    it, recorded without a group under the older default, are refused on purpose: see
    tests/cache/quantized/test_quant_defaults.py)."""
    data = json.loads((QUANTIZED_RUNS / "bits8-group64" / "run.json").read_text())
    recorded = data["runs"][-1]["config"]
    config = SweepConfig(**{k: v for k, v in recorded.items() if k != "out"}, out=Path(recorded["out"]))
    assert list(config.identity().items()) == list(data["identity"].items())
    assert list(config.to_json().items()) == list(recorded.items())


def test_the_cache_options_as_a_config_file_gives_them(tmp_path: Path) -> None:
    """``cache=``: text converted strictly by the core (``CacheSpec.parse``), recorded as ints; a
    value it would have to replace, or an option that is not the sweep's, refused in one sentence."""
    text = SweepConfig(out=tmp_path / "a", cache={"kv_bits": "8", "kv_group_size": "16"}, **COMMON)  # type: ignore[arg-type]
    flat = SweepConfig(out=tmp_path / "b", kv_bits=8, kv_group_size=16, **COMMON)  # type: ignore[arg-type]
    assert text.cache == flat.cache == {"kv_bits": 8, "kv_group_size": 16}
    assert text.identity() == flat.identity() and text.to_json()["kv_group_size"] == 16
    unquantized = SweepConfig(out=tmp_path / "c", cache={"kv_bits": 16, "decode_budget": None}, **COMMON)  # type: ignore[arg-type]
    assert unquantized.cache == {} and "kv_bits" not in unquantized.to_json()
    with pytest.raises(ValueError, match="whole number"):
        SweepConfig(out=tmp_path / "d", cache={"kv_bits": 8, "kv_group_size": 1.5}, **COMMON)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget is not a cache option of a sweep"):
        SweepConfig(out=tmp_path / "e", cache={"budget": 0.5}, **COMMON)  # type: ignore[arg-type]


def test_a_residual_longer_than_a_token_budget_is_refused_before_any_work(tmp_path: Path) -> None:
    """Each row is checked as it will run (``CacheSpec.replaced``): 64 exact tokens do not fit a
    budget of 32 entries per head."""
    with pytest.raises(ValueError, match=r"residual \(64 tokens\) is longer than the budget \(32 entries"):
        SweepConfig(out=tmp_path / "r", kv_bits=8, kv_residual=64, budgets=[0.2, 32], **COMMON)  # type: ignore[arg-type]
