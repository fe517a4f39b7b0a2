"""Load generator for ``criticalkv serve``: sessions under a memory cap, aggregate tokens/s, TTFT.

For each (method, budget) it starts ``criticalkv serve`` on 127.0.0.1 (the default model, a
fixed ``--memory-cap``; one server per configuration, all running side by side), stores
``--documents`` long documents (POST /v1/contexts), then, for each N in ``--clients`` and each
configuration in turn (interleaved, so both see the same load), sends N chat requests at once
(client i asks about document i mod D, over HTTP) and times them: aggregate completion tokens
per second over the burst's wall time. It also times the first token of a question on a stored
context against one whose document comes in the prompt (compressed anew). One JSON line per
measurement goes to ``--out`` as soon as it is taken.

Resumable: with ``--store-root`` each configuration's contexts stay in a folder of their own,
and a rerun with the same ``--out`` reuses them and skips the measurements already written.

    PYTHONPATH=src python benchmarks/serving_load.py --out docs/results/serving/load.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from criticalkv.bench.serving_client import burst, document, first_token, metric, start_server


def done_keys(path: Path) -> set[tuple[Any, ...]]:
    """The measurements ``path`` already holds (to skip on a rerun), with the contexts records."""
    keys: set[tuple[Any, ...]] = set()
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                keys.add((r["kind"], r["method"], r["budget"], r.get("kv_bits", 16), r.get("words"), r.get("clients"),
                          r.get("repeat")))  # fmt: skip
    return keys


def stall_done(args: argparse.Namespace, target: Target) -> bool:
    """Whether ``--out`` holds this stall measurement already (same config, document and path)."""
    if not args.out.exists():
        return False
    want = (target.method, target.budget, target.bits, args.words, args.stall_via, args.offload_prompt_tokens)
    for line in args.out.read_text().splitlines():
        r = json.loads(line) if line.strip() else {}
        got = (r.get("method"), r.get("budget"), r.get("kv_bits", 16), r.get("words"), r.get("stall_via", "post"),
               r.get("offload_prompt_tokens"))  # fmt: skip
        if r.get("kind") == "stall" and got == want:
            return True
    return False


def contexts_record(path: Path, method: str, budget: float, bits: int) -> dict[str, Any] | None:
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [
        r
        for r in records
        if r["kind"] == "contexts" and (r["method"], r["budget"], r.get("kv_bits", 16)) == (method, budget, bits)
    ]
    return found[-1] if found else None


class Target:
    """One configuration's server, its stored documents and the fields of its records."""

    def __init__(self, method: str, budget: float, bits: int, port: int, args: argparse.Namespace) -> None:
        self.method, self.budget, self.bits, self.args = method, budget, bits, args
        root = Path(args.store_root) if args.store_root else Path(tempfile.mkdtemp(prefix="criticalkv-load-"))
        self.store = root / (f"{method}-{budget}" + ("" if bits == 16 else f"-{bits}bit"))
        self.server = start_server(port, self.store, method, budget, bits, args)
        self.url = f"http://127.0.0.1:{port}"
        self.base = {"method": method, "budget": budget, "memory_cap_mib": args.memory_cap_mib,
                     "window": args.window, "words": args.words, "kv_bits": bits}  # fmt: skip
        self.docs = [document(i, args.words) for i in range(args.documents)]
        self.ids: list[str] = []

    def create(self, out: Any, lock: threading.Lock) -> None:
        """Store the documents, or find them stored by an earlier run of the same ``--out``."""
        old = contexts_record(self.args.out, self.method, self.budget, self.bits)
        ids = old["ids"] if old is not None and old.get("words") == self.args.words else []
        if len(ids) == len(self.docs) and all(
            httpx.get(f"{self.url}/v1/contexts/{i}", timeout=60).status_code == 200 for i in ids
        ):
            self.ids = ids
            return
        infos = []
        for text, _ in self.docs:
            started = time.perf_counter()
            info = httpx.post(self.url + "/v1/contexts", json={"text": text}, timeout=7200).json()
            info["create_s"] = time.perf_counter() - started
            infos.append(info)
            print(self.method, "context", len(infos), round(info["create_s"], 1), flush=True)
        self.ids = [i["id"] for i in infos]
        kv = max(i["kv_bytes"] for i in infos)
        cap = int(self.args.memory_cap_mib * 2**20)
        record = {**self.base, "kind": "contexts", "tokens": [i["tokens"] for i in infos], "kv_bytes": kv,
                  "sessions_fit": cap // kv, "create_s": [round(i["create_s"], 2) for i in infos],
                  "ids": self.ids}  # fmt: skip
        write(out, lock, record)

    def burst(self, n: int, repeat: int, out: Any, lock: threading.Lock) -> None:
        picks = [i % len(self.docs) for i in range(n)]
        before = {k: metric(self.url, k) for k in TTFT_KEYS}
        ids, questions = [self.ids[i] for i in picks], [self.docs[i][1] for i in picks]
        result = burst(self.url, ids, questions, self.args.max_tokens, model=self.args.model)
        after = {k: metric(self.url, k) for k in TTFT_KEYS}
        count = after[TTFT_KEYS[1]] - before[TTFT_KEYS[1]]
        result.update(self.base, kind="burst", clients=n, repeat=repeat, documents=len(self.docs))
        result["ttft_mean_s"] = (after[TTFT_KEYS[0]] - before[TTFT_KEYS[0]]) / count if count else None
        for name in ("decode_rows_max", "start_rows_max"):
            result[name] = metric(self.url, f"criticalkv_{name}")
        write(out, lock, result)
        print(self.method, self.budget, n, repeat, round(result["tokens_per_s"], 3), flush=True)

    def ttft(self, repeat: int, out: Any, lock: threading.Lock) -> None:
        text, question = self.docs[0]
        stored = first_token(self.url, question, self.ids[0], model=self.args.model)
        fresh = first_token(self.url, question, None, content=text + "\n\n", model=self.args.model)
        write(out, lock, {**self.base, "kind": "ttft", "repeat": repeat, "stored_s": stored, "compress_anew_s": fresh})

    def stall(self, out: Any, lock: threading.Lock) -> None:
        """The longest gap between the streamed tokens of an answer while a new document of
        ``--stall-words`` words arrives after its first token: posted as a context (``--stall-via
        post``, compressed and stored) or sent as a chat prompt without ``context_id`` (``chat``)."""
        text, question = document(self.args.documents, self.args.stall_words)
        via = self.args.stall_via
        body = {"model": self.args.model, "messages": [{"role": "user", "content": self.docs[0][1]}],
                "max_tokens": self.args.max_tokens, "stream": True, "context_id": self.ids[0]}  # fmt: skip
        times: list[float] = []
        sent: dict[str, Any] = {}

        def send() -> None:
            started = time.perf_counter()
            if via == "post":
                info = httpx.post(self.url + "/v1/contexts", json={"text": text}, timeout=7200).json()
                sent.update(tokens=info["tokens"])
            else:
                prompt = {"model": self.args.model, "max_tokens": 1,
                          "messages": [{"role": "user", "content": text + "\n\n" + question}]}  # fmt: skip
                reply = httpx.post(self.url + "/v1/chat/completions", json=prompt, timeout=7200).json()
                sent.update(tokens=reply["usage"]["prompt_tokens"])
            sent.update(post_s=time.perf_counter() - started, started=started)

        sender = threading.Thread(target=send)
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=7200) as response:
            for line in response.iter_lines():
                if (
                    line.startswith("data: ")
                    and line != "data: [DONE]"
                    and json.loads(line[6:])["choices"][0]["delta"].get("content")
                ):
                    times.append(time.perf_counter())
                    if len(times) == 1:
                        sender.start()
        sender.join()
        gaps = [b - a for a, b in itertools.pairwise(times)]
        write(out, lock, {**self.base, "kind": "stall", "stall_via": via, "streamed_tokens": len(times),
                          "offload_prompt_tokens": self.args.offload_prompt_tokens,
                          "max_gap_s": max(gaps, default=0.0), "gaps_s": gaps, "document_tokens": sent["tokens"],
                          "post_s": sent["post_s"],
                          "post_after_first_token_s": sent["started"] - times[0]})  # fmt: skip

    def stop(self) -> None:
        self.server.terminate()
        self.server.wait(timeout=60)


TTFT_KEYS = ("criticalkv_time_to_first_token_seconds_sum", "criticalkv_time_to_first_token_seconds_count")


def write(out: Any, lock: threading.Lock, record: dict[str, Any]) -> None:
    with lock:
        out.write(json.dumps(record) + "\n")
        out.flush()


def measure(args: argparse.Namespace, out: Any) -> None:
    """Every configuration's server side by side; contexts created concurrently, then each
    measurement for every configuration in turn."""
    lock = threading.Lock()
    configs = [
        (p[0], float(p[1]), int(p[2]) if len(p) > 2 else 16) for p in (c.split(":") for c in args.configs.split(","))
    ]
    targets = [Target(m, b, bits, args.port + k, args) for k, (m, b, bits) in enumerate(configs)]
    try:
        threads = [threading.Thread(target=t.create, args=(out, lock)) for t in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        done = done_keys(args.out)
        for n in args.clients:
            for repeat in range(args.repeats):
                for t in targets:
                    if ("burst", t.method, t.budget, t.bits, args.words, n, repeat) not in done:
                        t.burst(n, repeat, out, lock)
        for repeat in range(args.ttft_repeats):
            for t in targets:
                if ("ttft", t.method, t.budget, t.bits, args.words, None, repeat) not in done:
                    t.ttft(repeat, out, lock)
        if args.stall_words and not stall_done(args, targets[0]):
            targets[0].stall(out, lock)
    finally:
        for t in targets:
            t.stop()


def report(path: Path) -> str:
    """Markdown tables of the measurements in ``path`` (medians over repeats)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    head = "| method | budget | kv bits | tokens per context | KV bytes per context | sessions that fit the cap | create s |"  # noqa: E501
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in (r for r in records if r["kind"] == "contexts"):
        lines.append(f"| {r['method']} | {r['budget']} | {r.get('kv_bits', 16)} | {r['tokens']} | {r['kv_bytes']:,} | "
                     f"{r['sessions_fit']} | {r['create_s']} |")  # fmt: skip
    lines += ["", "| method | budget | kv bits | N clients | aggregate tokens/s (each repeat) | median | "
              "burst wall s | tokens | mean TTFT s | most rows in one step / one start (server so far) |",
              "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    bursts = [r for r in records if r["kind"] == "burst"]

    def burst_key(r: dict[str, Any]) -> tuple[str, float, int, int]:
        return r["method"], r["budget"], r.get("kv_bits", 16), r["clients"]

    for key in sorted({burst_key(r) for r in bursts}, key=lambda k: (k[3], -k[1], -k[2])):
        rs = [r for r in bursts if burst_key(r) == key]
        rates = sorted(r["tokens_per_s"] for r in rs)
        walls = ", ".join(f"{r['wall_s']:.1f}" for r in rs)
        each = ", ".join(f"{x:.3f}" for x in rates)
        rows = f"{int(rs[-1]['decode_rows_max'])} / {int(rs[-1].get('start_rows_max', 1))}"
        ttft = ", ".join(f"{r['ttft_mean_s']:.1f}" for r in rs if r.get("ttft_mean_s") is not None) or "-"
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {each} | {statistics.median(rates):.3f} | "
                     f"{walls} | {rs[0]['tokens']} | {ttft} | {rows} |")  # fmt: skip
    lines += ["", "| method | budget | first token, stored context (s) | first token, compressed anew (s) |",
              "|---|---|---|---|"]  # fmt: skip
    for r in (r for r in records if r["kind"] == "ttft"):
        lines.append(f"| {r['method']} | {r['budget']} | {r['stored_s']:.2f} | {r['compress_anew_s']:.2f} |")
    lines += ["", "| method | budget | kv bits | document sent as | its tokens | its request s | streamed tokens | "
              "longest gap s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in (r for r in records if r["kind"] == "stall"):
        lines.append(f"| {r['method']} | {r['budget']} | {r['kv_bits']} | {r.get('stall_via', 'post')} | "
                     f"{r['document_tokens']} | {r['post_s']:.1f} | {r['streamed_tokens']} | "
                     f"{r['max_gap_s']:.2f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", action="store_true", help="print markdown tables of --out and exit")
    parser.add_argument("--model", default="default", help="what `criticalkv serve --model` takes")
    parser.add_argument("--configs", default="full:1.0,critical-adakv:0.2", help="method:budget[:kv_bits],...")
    parser.add_argument("--clients", default="1,4,8", type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--words", type=int, default=3000, help="words per document (about 4K tokens)")
    parser.add_argument("--memory-cap-mib", type=float, default=480.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=8765, help="the first configuration's; the next ones follow")
    parser.add_argument("--documents", type=int, default=None, help="distinct documents (default: the most clients)")
    parser.add_argument("--ttft-repeats", type=int, default=1)
    parser.add_argument("--store-root", default=None, help="keep the stores here (a rerun reuses them)")
    parser.add_argument(
        "--stall-words",
        type=int,
        default=0,
        help="post a document of this many words while an answer streams (the first config's)",
    )
    parser.add_argument("--stall-via", choices=("post", "chat"), default="post",
                        help="the stall's document: POSTed as a context, or sent as a chat prompt")  # fmt: skip
    parser.add_argument("--offload-prompt-tokens", type=int, default=None,
                        help="passed to every server (default: the server's own)")  # fmt: skip
    args = parser.parse_args()
    if args.report:
        print(report(args.out))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.documents is None:
        args.documents = max(args.clients, default=1)
    with args.out.open("a") as out:
        measure(args, out)


if __name__ == "__main__":
    main()
