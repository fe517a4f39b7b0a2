"""lm-eval's offline RULER niah tasks on the default model through ``criticalkv lm-eval``, one run
per (task, method), then the table of docs/results/lm-eval.md (with --report).

Resumable: a (task, method) whose results file exists is skipped, and each run keeps lm-eval's
request cache (``--use_cache``), so a run stopped midway answers its finished requests from it.

    python benchmarks/lmeval_ruler.py --out docs/results/lm-eval/runs --limit 10
    python benchmarks/lmeval_ruler.py --out docs/results/lm-eval/runs --report
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

METHODS = ("full", "snapkv", "critical-snapkv", "adakv", "critical-adakv", "defensivekv", "layer-defensivekv")
#: lm-eval's RULER niah tasks whose haystack needs no download (the others read Paul Graham's essays from the hub)
TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")
LENGTH = 1024


def command(task: str, method: str, budget: float, limit: int, out: Path, tokenizer: str) -> list[str]:
    """The ``criticalkv lm-eval`` command line of one run."""
    metadata = json.dumps({"max_seq_lengths": [LENGTH], "tokenizer": tokenizer})
    model_args = f"pretrained=default,method={method},budget={budget}"
    return [
        *("criticalkv", "lm-eval", "--model", "criticalkv", "--model_args", model_args, "--tasks", task),
        *("--metadata", metadata, "--limit", str(limit), "--gen_kwargs", "max_gen_toks=32", "--device", "cpu"),
        *("--batch_size", "1", "--log_samples", "--output_path", str(out), "--use_cache", str(out / "cache")),
    ]


def results_file(out: Path) -> Path | None:
    found = sorted(out.glob("*/results_*.json"))
    return found[-1] if found else None


def run_all(args: argparse.Namespace) -> None:
    from criticalkv.models import default_model_dir, load_tokenizer

    load_tokenizer("default")  # converts the default model once if needed
    for task in args.tasks.split(","):
        for method in args.methods.split(","):
            out = args.out / task / method
            if results_file(out) is not None:
                print(f"{task} {method}: done", flush=True)
                continue
            out.mkdir(parents=True, exist_ok=True)
            line = command(task, method, args.budget, args.limit, out, str(default_model_dir()))
            print(" ".join(line), flush=True)
            entry = [sys.executable, "-c", "import sys; from criticalkv.cli import main; sys.exit(main())"]
            subprocess.run([*entry, *line[1:]], check=True)


def interval(scores: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap 95% interval of the mean (as the eval report's)."""
    values = np.asarray(scores, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    low, high = np.quantile(values[picks].mean(axis=1), [0.025, 0.975])
    return float(low), float(high)


def ours(results: Path | None, budget: float) -> dict[tuple[str, str], list[float]]:
    """Our RULER harness's scores (percent) at ``LENGTH`` tokens per (task, method): the budget, or 1.0 for full."""
    if results is None:
        return {}
    found: dict[tuple[str, str], list[float]] = {}
    for line in results.read_text().splitlines():
        r = json.loads(line)
        if r["length"] == LENGTH and float(r["budget"]) == (1.0 if r["method"] == "full" else budget):
            found.setdefault((r["task"], r["method"]), []).append(100 * float(r["score"]))
    return found


def _cell(scores: list[float] | None) -> str:
    if not scores:
        return "- | - | -"
    low, high = interval(scores)
    return f"{np.mean(scores):.1f} | [{low:.1f}, {high:.1f}] | {len(scores)}"


def report(out: Path, harness: Path | None = None, budget: float = 0.2) -> str:
    """The markdown table: per (task, method) lm-eval's mean score in percent, its interval, n and
    the mean KV ratio, beside our harness's score, interval and n (from ``harness``, a results.jsonl)."""
    theirs = ours(harness, budget)
    rows = [
        "| task | method | lm-eval score % | 95% interval | n | kv_bytes / full | our harness % | 95% interval | n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for task_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        for method in METHODS:
            found = results_file(task_dir / method)
            if found is None:
                continue
            samples = sorted(found.parent.glob(f"samples_{task_dir.name}_*.jsonl"))[-1]
            scores = [100 * float(json.loads(line)[str(LENGTH)]) for line in samples.read_text().splitlines()]
            ratio = json.loads(found.read_text())["config"]["criticalkv"]["kv_ratio_mean"]
            mine = theirs.get((task_dir.name, method))
            rows.append(f"| {task_dir.name} | {method} | {_cell(scores)} | {ratio:.3f} | {_cell(mine)} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--budget", type=float, default=0.2)
    parser.add_argument("--limit", type=int, default=10, help="samples per task (lm-eval's --limit)")
    parser.add_argument("--report", action="store_true", help="print the table of what finished, run nothing")
    parser.add_argument("--ours", type=Path, help="our RULER harness's results.jsonl, for the table's last columns")
    args = parser.parse_args()
    if args.report:
        print(report(args.out, args.ours, args.budget))
    else:
        run_all(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
