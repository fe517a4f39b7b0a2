"""Load generator for ``criticalkv serve``: sessions under a memory cap, aggregate tokens/s, TTFT.

For each (method, budget) it starts ``criticalkv serve`` on 127.0.0.1 (the default model, a
fixed ``--memory-cap``), stores one long document per client (POST /v1/contexts), then, for
each N in ``--clients``, sends N chat requests at once (client i asks about document i, over
HTTP) and times them: aggregate completion tokens per second over the burst's wall time. It
also times the first token of a question on a stored context against one whose document comes
in the prompt (compressed anew). One JSON line per measurement goes to ``--out``.

    PYTHONPATH=src python benchmarks/serving_load.py --out docs/results/serving/load.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from criticalkv.haystack import essay_words, needle_question, needle_sentence

QUESTION_KEY = "document {i}"


def document(i: int, words: int) -> tuple[str, str]:
    """Document ``i`` (``words`` words of the natural haystack from offset ``i * 997``, a needle in
    the middle) and its question."""
    pool = essay_words()
    start = (i * 997) % max(len(pool) - words, 1)
    text = pool[start : start + words]
    needle = needle_sentence(QUESTION_KEY.format(i=i), str(1000 + 37 * i))
    middle = len(text) // 2
    return " ".join([*text[:middle], needle, *text[middle:]]), needle_question(QUESTION_KEY.format(i=i))


def start_server(port: int, store: Path, method: str, budget: float, cap_mib: float, args: argparse.Namespace) -> Any:
    command = [
        sys.executable, "-m", "criticalkv.cli", "serve", "--model", "default", "--method", method,
        "--budget", str(budget), "--window", str(args.window), "--memory-cap", str(cap_mib),
        "--max-batch", str(args.max_batch), "--max-sessions", str(4 * args.max_batch),
        "--max-new-tokens", str(args.max_tokens), "--host", "127.0.0.1", "--port", str(port), "--store", str(store),
    ]  # fmt: skip
    server = subprocess.Popen(command, env=os.environ.copy(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError("the server did not start within 600 s")


def chat(url: str, question: str, max_tokens: int, context_id: str | None, content: str = "") -> dict[str, Any]:
    """One request (not streamed): its wall time, completion tokens and answer."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": content + question}],
        "max_tokens": max_tokens,
    }
    if context_id is not None:
        body["context_id"] = context_id
    started = time.perf_counter()
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=3600)
    if response.status_code != 200:
        raise RuntimeError(f"{response.status_code}: {response.text}")
    reply = response.json()
    text = reply["choices"][0]["message"]["content"]
    return {"wall_s": time.perf_counter() - started, "tokens": int(reply["usage"]["completion_tokens"]), "text": text}


def first_token(url: str, question: str, context_id: str | None, content: str = "") -> float:
    """Seconds from sending a streamed request to its first event with text or its end."""
    body: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": content + question}],
                            "max_tokens": 4, "stream": True}  # fmt: skip
    if context_id is not None:
        body["context_id"] = context_id
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content") or choice.get("finish_reason"):
                return time.perf_counter() - started
    return time.perf_counter() - started


def burst(url: str, ids: list[str], questions: list[str], max_tokens: int) -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in ids]
    gate = threading.Barrier(len(ids))

    def run(i: int) -> None:
        gate.wait()
        results[i] = chat(url, questions[i], max_tokens, ids[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ids))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    walls = sorted(r["wall_s"] for r in results)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "request_s_median": walls[len(walls) // 2],
            "answers": [r["text"] for r in results]}  # fmt: skip


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def measure(method: str, budget: float, port: int, args: argparse.Namespace, out: Any) -> None:
    with tempfile.TemporaryDirectory(prefix="criticalkv-load-") as store:
        server = start_server(port, Path(store), method, budget, args.memory_cap_mib, args)
        url = f"http://127.0.0.1:{port}"
        base = {"method": method, "budget": budget, "memory_cap_mib": args.memory_cap_mib, "window": args.window}
        try:
            docs = [document(i, args.words) for i in range(max(args.clients))]
            ids, infos = [], []
            for text, _ in docs:
                started = time.perf_counter()
                info = httpx.post(url + "/v1/contexts", json={"text": text}, timeout=3600).json()
                info["create_s"] = time.perf_counter() - started
                ids.append(info["id"])
                infos.append(info)
            kv = max(i["kv_bytes"] for i in infos)
            cap = int(args.memory_cap_mib * 2**20)
            record = {**base, "kind": "contexts", "tokens": [i["tokens"] for i in infos], "kv_bytes": kv,
                      "sessions_fit": cap // kv, "create_s": [round(i["create_s"], 2) for i in infos]}  # fmt: skip
            out.write(json.dumps(record) + "\n")
            out.flush()
            for n in args.clients:
                for repeat in range(args.repeats):
                    result = burst(url, ids[:n], [q for _, q in docs[:n]], args.max_tokens)
                    result.update(base, kind="burst", clients=n, repeat=repeat)
                    result["decode_rows_max"] = metric(url, "criticalkv_decode_rows_max")
                    out.write(json.dumps(result) + "\n")
                    out.flush()
                    print(method, budget, n, repeat, round(result["tokens_per_s"], 2), flush=True)
            for repeat in range(args.repeats):
                text, question = docs[0]
                stored = first_token(url, question, ids[0])
                fresh = first_token(url, question, None, content=text + "\n\n")
                record = {**base, "kind": "ttft", "repeat": repeat, "stored_s": stored, "compress_anew_s": fresh}
                out.write(json.dumps(record) + "\n")
                out.flush()
        finally:
            server.terminate()
            server.wait(timeout=60)


def report(path: Path) -> str:
    """Markdown tables of the measurements in ``path`` (medians over repeats)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    head = "| method | budget | tokens per context | KV bytes per context | sessions that fit the cap | create s |"
    lines = [head, "|---|---|---|---|---|---|"]
    for r in (r for r in records if r["kind"] == "contexts"):
        lines.append(f"| {r['method']} | {r['budget']} | {r['tokens']} | {r['kv_bytes']:,} | {r['sessions_fit']} | "
                     f"{r['create_s']} |")  # fmt: skip
    lines += ["", "| method | budget | N clients | aggregate tokens/s (each repeat) | median | burst wall s | "
              "tokens | most rows in one step (server so far) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    bursts = [r for r in records if r["kind"] == "burst"]
    for key in sorted({(r["method"], r["budget"], r["clients"]) for r in bursts}, key=lambda k: (k[2], -k[1])):
        rs = [r for r in bursts if (r["method"], r["budget"], r["clients"]) == key]
        rates = sorted(r["tokens_per_s"] for r in rs)
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in rs)
        each = ", ".join(f"{x:.3f}" for x in rates)
        rows = int(rs[-1]["decode_rows_max"])
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {each} | {statistics.median(rates):.3f} | {walls} | "
                     f"{rs[0]['tokens']} | {rows} |")  # fmt: skip
    lines += ["", "| method | budget | first token, stored context (s) | first token, compressed anew (s) |",
              "|---|---|---|---|"]  # fmt: skip
    for r in (r for r in records if r["kind"] == "ttft"):
        lines.append(f"| {r['method']} | {r['budget']} | {r['stored_s']:.2f} | {r['compress_anew_s']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", action="store_true", help="print markdown tables of --out and exit")
    parser.add_argument("--configs", default="full:1.0,critical-adakv:0.2", help="method:budget,...")
    parser.add_argument("--clients", default="1,4,8", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--words", type=int, default=3000, help="words per document (about 4K tokens)")
    parser.add_argument("--memory-cap-mib", type=float, default=480.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    if args.report:
        print(report(args.out))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for config in args.configs.split(","):
            method, budget = config.split(":")
            measure(method, float(budget), args.port, args, out)


if __name__ == "__main__":
    main()
