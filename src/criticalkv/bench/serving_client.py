"""HTTP client side of the serving benchmarks (``benchmarks/serving_load.py``): the documents, a
``criticalkv serve`` subprocess on 127.0.0.1, chat requests (plain and streamed), bursts of
concurrent requests and ``/metrics`` reads. It needs ``httpx`` (the ``dev`` extra); nothing else in
the package imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from criticalkv.headscores.haystack import essay_words, needle_question, needle_sentence

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


def start_server(port: int, store: Path, method: str, budget: float, bits: int, args: argparse.Namespace) -> Any:
    cap_mib = args.memory_cap_mib
    command = [
        sys.executable, "-m", "criticalkv.cli", "serve", "--model", args.model, "--method", method,
        "--budget", str(budget), "--window", str(args.window), "--memory-cap", str(cap_mib),
        "--max-batch", str(args.max_batch), "--max-sessions", str(4 * args.max_batch),
        "--max-new-tokens", str(args.max_tokens), "--host", "127.0.0.1", "--port", str(port), "--store", str(store),
        "--kv-bits", str(bits),
    ]  # fmt: skip
    if getattr(args, "offload_prompt_tokens", None) is not None:
        command += ["--offload-prompt-tokens", str(args.offload_prompt_tokens)]
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


def chat(
    url: str, question: str, max_tokens: int, context_id: str | None, content: str = "", model: str = "default"
) -> dict[str, Any]:
    """One request (not streamed) for the served ``model``: its wall time, completion tokens and answer."""
    body: dict[str, Any] = {
        "model": model,
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


def first_token(url: str, question: str, context_id: str | None, content: str = "", model: str = "default") -> float:
    """Seconds from sending a streamed request to its first event with text or its end."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content + question}],
                            "max_tokens": 4, "stream": True}  # fmt: skip
    if context_id is not None:
        body["context_id"] = context_id
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.read().decode()}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content") or choice.get("finish_reason"):
                return time.perf_counter() - started
    return time.perf_counter() - started


def burst(url: str, ids: list[str], questions: list[str], max_tokens: int, model: str = "default") -> dict[str, Any]:
    results: list[dict[str, Any]] = [{} for _ in ids]
    gate = threading.Barrier(len(ids))

    def run(i: int) -> None:
        gate.wait()
        results[i] = chat(url, questions[i], max_tokens, ids[i], model=model)

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
