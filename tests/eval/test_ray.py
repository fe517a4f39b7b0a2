"""Sweeps on Ray (a local 2-CPU cluster started here) and model placement with ``device_map``.

The Ray path must write exactly what the local runner writes (same keys, same scores), resume
across both paths, and lose or duplicate nothing when a worker dies in the middle of a unit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from criticalkv.cli import main
from criticalkv.eval import results as sweep_results
from criticalkv.eval.ray import RayOptions, build_units, run_sweep_ray
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.models import load_model, load_tokenizer
from criticalkv.runs import JsonLines
from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'criticalkv[ray]')")

TIMINGS = {"prefill_s", "compress_s", "batch_decode_s"}
TASKS = ["niah_single_1", "qa_1"]
METHODS = ["full", "snapkv", "critical-snapkv", "h2o"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama and the character tokenizer, saved where a worker can load them."""
    path = tmp_path_factory.mktemp("models") / "tiny-llama"
    make_tiny("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _config(out: Path, folder: Path, **kw: Any) -> SweepConfig:
    base: dict[str, Any] = dict(
        out=out,
        tasks=TASKS,
        lengths=[600],
        methods=METHODS,
        budgets=[0.3, 0.6],
        samples=2,
        window=8,
        max_new_tokens=4,
        model=str(folder),
    )
    base.update(kw)
    return SweepConfig(**base)


def _records(out: Path) -> list[dict[str, Any]]:
    records = [{k: v for k, v in r.items() if k not in TIMINGS} for r in sweep_results.read_results(out)]
    return sorted(records, key=sweep_results.result_key)


def _assert_same(records: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    keys = [sweep_results.result_key(r) for r in records]
    assert len(keys) == len(set(keys)), "a key was written twice"
    assert keys == [sweep_results.result_key(r) for r in reference]
    for got, want in zip(records, reference, strict=True):
        assert got["prediction"] == want["prediction"] and got["score"] == want["score"], sweep_results.result_key(got)
        assert got["kv_bytes"] == want["kv_bytes"]
        for field in ("nll", "kl", "top1", "partial"):
            assert got[field] == pytest.approx(want[field], abs=1e-5), (field, sweep_results.result_key(got))


@pytest.fixture(scope="module")
def reference(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The local runner's records for the whole config."""
    out = tmp_path_factory.mktemp("local") / "run"
    model, tokenizer = load_model(folder, device="cpu")
    run_sweep(_config(out, folder), model, tokenizer)
    records = _records(out)
    assert len(records) == len(TASKS) * 2 * (1 + (len(METHODS) - 1) * 2)
    return records


@pytest.fixture(scope="module")
def crash_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hooks") / "crash-once"


def crash_once(flag: Path) -> Callable[[], None]:
    """A worker hook: the first worker that removes ``flag`` exits at once, as if it were killed.

    The hook is a closure, so Ray pickles it by value: workers need not import this module.
    """
    path = str(flag)

    def hook() -> None:
        try:
            os.remove(path)  # only one worker wins
        except FileNotFoundError:
            return
        os._exit(1)

    return hook


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    if not HAVE_RAY:
        pytest.skip("ray is not installed (pip install 'criticalkv[ray]')")
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


# --- without Ray ---------------------------------------------------------------------------------


def test_without_ray_the_flag_fails_with_the_install_command(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "run"
    assert main(["eval", "--model", str(folder), "--tasks", "niah_single_1", "--out", str(out), "--ray"]) == 2
    assert "pip install -e '.[ray]'" in capsys.readouterr().err
    assert not out.exists()


def test_ray_options_are_checked() -> None:
    with pytest.raises(ValueError, match="--ray-workers"):
        RayOptions(workers=0)
    with pytest.raises(ValueError, match="CPUs or GPUs"):
        RayOptions(cpus_per_worker=0)
    with pytest.raises(ValueError, match="not both"):
        RayOptions(device="cpu", device_map="auto")


def test_units_cover_the_pending_work_in_order(folder: Path, tmp_path: Path) -> None:
    config = _config(tmp_path, folder)
    tokenizer = load_tokenizer(folder)
    units, already = build_units(config, tokenizer, {}, samples_per_unit=3)
    assert already == 0 and [len(u.items) for u in units] == [3, 1]
    assert {u.model for u in units} == {str(folder)}
    assert sum(u.num_records for u in units) == 4 * len(config.configs())
    first = units[0].items[0]
    done: dict[str, str | None] = {
        f"{first.sample.task}|600|{first.sample.index}|{m}|{b}": None for m, b in config.configs()
    }
    units, already = build_units(config, tokenizer, done, samples_per_unit=3)
    assert already == len(config.configs()) and [len(u.items) for u in units] == [3]


class _Died(Exception):
    """Stands in for ray.exceptions.ActorDiedError."""


class _FakeRay:
    """Just what the dispatcher uses of ``ray``, executing every call at once."""

    class exceptions:  # mirrors ray.exceptions
        RayError = type("RayError", (Exception,), {})
        RayActorError = _Died
        WorkerCrashedError = ObjectLostError = OutOfMemoryError = RayError
        RayTaskError = type("RayTaskError", (RayError,), {})

    killed: list[Any]

    def __init__(self) -> None:
        self.killed = []

    def wait(self, refs: list[Any], num_returns: int = 1) -> tuple[list[Any], list[Any]]:
        return refs[:1], refs[1:]

    def get(self, ref: Any) -> Any:
        return ref()

    def kill(self, worker: Any, no_restart: bool = True) -> None:
        self.killed.append(worker)


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return lambda: self.fn(*args)


def test_dispatch_retries_a_dead_workers_unit_and_writes_each_key_once(tmp_path: Path) -> None:
    from criticalkv.eval.ray import UnitResult, WorkerPool, WorkUnit, dispatch
    from criticalkv.eval.sample import Sample
    from criticalkv.eval.sweep import UnitItem, record_key

    def unit(index: int) -> WorkUnit:
        sample = Sample("t", index, "c", "q", ["a"], "string_match_part", 4)
        return WorkUnit("m", (UnitItem(600, sample, (("full", 1.0), ("snapkv", 0.2))),))

    calls: list[int] = []

    def run(work: WorkUnit) -> UnitResult:
        index = work.items[0].sample.index
        calls.append(index)
        if calls.count(0) == 1 and index == 0:
            raise _Died("killed")
        records = [{**record_key("t", 600, index, m, b), "score": 1.0} for m, b in work.items[0].pending]
        if index == 1:  # a recomputed result that is already on disk
            records.append({**record_key("t", 600, 0, "full", 1.0), "score": 1.0})
        return UnitResult(records, 0.0, "fake")

    def spawn() -> Any:
        worker = type("Worker", (), {})()
        worker.setup, worker.run = _Method(lambda: {"worker": "fake"}), _Method(run)
        return worker

    fake = _FakeRay()
    pool = WorkerPool(fake, spawn, 1)  # type: ignore[arg-type]
    done: dict[str, str | None] = {}
    dispatch(fake, pool, [unit(0), unit(1)], tmp_path, done, 0, RayOptions())  # type: ignore[arg-type]
    keys = [sweep_results.result_key(r) for r in JsonLines(tmp_path / sweep_results.RESULTS).rows()]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 4
    assert calls.count(0) == 2 and len(fake.killed) == 1  # unit 0 ran again, on a fresh worker


def test_load_tokenizer_matches_load_model(folder: Path) -> None:
    _, expected = load_model(folder, device="cpu")
    tokenizer = load_tokenizer(folder)
    text = "The code is 1234. What is it?"
    assert tokenizer(text)["input_ids"] == expected(text)["input_ids"]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (
        expected.pad_token_id,
        expected.eos_token_id,
        "left",
    )


@pytest.mark.slow
def test_load_tokenizer_matches_load_model_for_the_default_model() -> None:
    _, expected = load_model("default", device="cpu")
    tokenizer = load_tokenizer("default")
    text = "Hello there, the magic number is 7205."
    assert tokenizer(text)["input_ids"] == expected(text)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token_id, len(tokenizer)) == (
        expected.eos_token,
        expected.pad_token_id,
        len(expected),
    )
    assert tokenizer.chat_template == expected.chat_template


# --- device_map ----------------------------------------------------------------------------------


def test_device_map_is_passed_through(
    folder: Path, tmp_path: Path, reference: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import criticalkv.models.checkpoint as checkpoint

    seen: list[dict[str, Any]] = []
    real = checkpoint.AutoModelForCausalLM

    class Spy:
        @staticmethod
        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            seen.append(kwargs)
            return real.from_pretrained(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "AutoModelForCausalLM", Spy)
    model, tokenizer = load_model(folder, device_map="auto")
    assert seen[-1]["device_map"] == "auto"
    load_model(folder, device="cpu")
    assert "device_map" not in seen[-1]
    out = tmp_path / "run"
    run_sweep(_config(out, folder), model, tokenizer)
    _assert_same(_records(out), reference)
    with pytest.raises(ValueError, match="not both"):
        load_model(folder, device="cpu", device_map="auto")
    with pytest.raises(TypeError, match="device_map"):
        load_model(folder, device_map=3)  # type: ignore[arg-type]


@torch.no_grad()
def test_compressed_cache_lives_on_each_layers_key_device(folder: Path) -> None:
    """Every tensor a layer holds is on the device (and dtype) of that layer's keys."""
    import criticalkv as ckv
    from criticalkv.cache.batch import stacked_cache
    from criticalkv.runtime import prefill
    from tests.conftest import padded_batch

    model, _ = load_model(folder, device_map="auto", dtype="bfloat16")
    ids, mask = padded_batch([60], seed=1)
    states, _ = prefill(model, ids, mask, window=6)
    configs = [("full", 1.0), ("critical-adakv", 0.3), ("snapkv", 0.5)]
    cache, _ = stacked_cache(states, [ckv.CacheSpec.of(m, b, 6) for m, b in configs])
    single = ckv.CompressedCache.from_states(states, "critical-adakv", 0.3)
    for compressed in (cache, single):
        rows = compressed.compressed_layers[0].batch_size
        for layer, state in zip(compressed.compressed_layers, states, strict=True):
            new = state.keys[:1, :, -1:].expand(rows, -1, -1, -1)
            layer.append(new, new)
            assert layer.storage.fused is not None and layer.keep is not None
            held = [layer.storage.fused.flat_keys, layer.storage.fused.flat_values, layer.keep]
            layer.storage.settle()  # and the tiers and tail it hands to readers
            assert layer.holds_prompt and layer.storage.tail_keys is not None and layer.storage.tail_values is not None
            held += [t for tier in layer.storage.prefix.tiers for t in (tier.keys, tier.values)]
            held += [layer.storage.tail_keys, layer.storage.tail_values]
            assert layer.device == state.keys.device and layer.dtype == state.keys.dtype == torch.bfloat16
            assert all(t.device == state.keys.device for t in held)


# --- on a local Ray cluster ----------------------------------------------------------------------


@needs_ray
@pytest.mark.slow
def test_ray_sweep_equals_local_and_resumes_across_paths(
    ray_cluster: Any, folder: Path, tmp_path: Path, reference: list[dict[str, Any]]
) -> None:
    with pytest.raises(ValueError, match="at most 1024 positions"):  # raised on a worker, re-raised here as itself
        run_sweep_ray(_config(tmp_path / "long", folder, lengths=[1022]), RayOptions(workers=1))
    out = tmp_path / "ray"
    args = ["eval", "--model", str(folder), "--tasks", ",".join(TASKS), "--lengths", "600", "--budgets", "0.3,0.6"]
    args += ["--methods", ",".join(METHODS), "--samples", "2", "--window", "8", "--max-new-tokens", "4"]
    assert main([*args, "--out", str(out), "--ray", "--ray-cpus-per-worker", "1"]) == 0
    _assert_same(_records(out), reference)
    assert "ray" in json.loads((out / "run.json").read_text())["runs"][0]["config"]

    # half locally, the rest on Ray, then nothing left for either
    mixed = tmp_path / "mixed"
    model, tokenizer = load_model(folder, device="cpu")
    run_sweep(_config(mixed, folder, samples=1), model, tokenizer)
    half = len(sweep_results.read_results(mixed))
    assert half == len(reference) // 2
    run_sweep_ray(_config(mixed, folder), RayOptions(workers=2))
    _assert_same(_records(mixed), reference)
    run_sweep(_config(mixed, folder), model, tokenizer)
    run_sweep_ray(_config(mixed, folder))
    assert len(sweep_results.read_results(mixed)) == len(reference)


@needs_ray
@pytest.mark.slow
@pytest.mark.parametrize("max_restarts", [2, 0], ids=["ray-restarts-the-worker", "driver-starts-a-fresh-worker"])
def test_a_worker_killed_midway_loses_and_duplicates_nothing(
    ray_cluster: Any, folder: Path, tmp_path: Path, crash_file: Path, reference: list[dict[str, Any]], max_restarts: int
) -> None:
    crash_file.write_text("the first worker to remove this file exits after its first sample")
    out = tmp_path / "run"
    options = RayOptions(workers=2, samples_per_unit=2, max_restarts=max_restarts)
    run_sweep_ray(_config(out, folder), options, after_sample=crash_once(crash_file))
    assert not crash_file.exists(), "no worker died"
    _assert_same(_records(out), reference)
