"""Ablations of CriticalKV's parts on RULER: eps, alpha and ``||V W_O||`` against the plain ``||V||``.

One command runs the sweep (``criticalkv eval`` with method specs such as ``critical-snapkv:eps=0``;
resumable, sample-major, so an interrupted run covers every task with fewer samples) and writes the
table between the markers of ``--doc``::

    python benchmarks/ablations.py --out runs/ablations --samples 5 --doc docs/results/ablations.md

``--no-run`` only rebuilds the table from the folder. The table compares the configurations on the
samples that all of them have (every variant, both bases, every budget), so its rows are paired:
each variant's difference from the default configuration (eps 1e-4, alpha 0.5, projected norms;
Feng et al. 2025, arXiv 2502.03805) is a paired bootstrap interval over those samples.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from criticalkv.eval.report import AVERAGE, MIN_PAIRED_SAMPLES, by_config, distinguishable, paired_difference, summarise
from criticalkv.eval.results import current_results, read_results

BASES = ("critical-snapkv", "critical-adakv")
#: (label, spec options) of each ablation; the first is the default configuration
VARIANTS: tuple[tuple[str, str], ...] = (
    ("default (eps 1e-4, alpha 0.5, ||V W_O||_1)", ""),
    ("eps = 0", ":eps=0"),
    ("eps = 1e-2", ":eps=0.01"),
    ("alpha = 0.25", ":alpha=0.25"),
    ("alpha = 0.75", ":alpha=0.75"),
    ("plain ||V||_1 (no W_O)", ":projected=false"),
    ("L2 ||V W_O||_2, Gram form", ":gram=true:p=2"),
)
BUDGETS = (0.1, 0.2, 0.4)
START, END = "<!-- ablation-table:start -->", "<!-- ablation-table:end -->"


def methods() -> list[str]:
    """The sweep's ``--methods``: the full cache, then every variant of every base."""
    return ["full", *(base + spec for base in BASES for _, spec in VARIANTS)]


def eval_arguments(out: Path, samples: int, tasks: str = "all", max_new_tokens: int = 32) -> list[str]:
    """The ``criticalkv eval`` command line of the sweep."""
    return [
        "eval", "--benchmark", "ruler", "--tasks", tasks, "--lengths", "1024",
        "--methods", ",".join(methods()), "--budgets", ",".join(map(str, BUDGETS)),
        "--samples", str(samples), "--mode", "question-aware", "--max-new-tokens", str(max_new_tokens),
        "--model", "default", "--out", str(out),
    ]  # fmt: skip


def common_samples(records: Sequence[Mapping[str, Any]], configs: Sequence[tuple[str, float]]) -> set[Any]:
    """The (task, length, index) keys every config in ``configs`` (and the full cache) has."""
    grouped = by_config(records)
    wanted = [("full", 1.0), *configs]
    keys = [set(grouped.get(c, {})) for c in wanted]
    return set.intersection(*keys) if keys else set()


def _interval(value: float, low: float, high: float, digits: int, sign: bool = False) -> str:
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    return f"{f.format(value)} [{f.format(low)}, {f.format(high)}]"


def _verdict(diff: Mapping[str, float], low: str, high: str) -> str:
    if diff["n"] < MIN_PAIRED_SAMPLES:
        return "too few"
    return "yes" if distinguishable(diff[low], diff[high]) else "no"


def table(records: Sequence[dict[str, Any]], fidelity_only: bool = False) -> tuple[str, int, dict[str, int]]:
    """The markdown table, the number of shared samples and the samples per task among them.

    ``fidelity_only``: the sweep generated one token, so the task scores mean nothing; the table
    shows the teacher-forced fidelity (NLL increase, top-1 agreement) alone.
    """
    configs = [(base + spec, b) for base in BASES for _, spec in VARIANTS for b in BUDGETS]
    shared = common_samples(records, configs)
    chosen = [r for r in records if (r["task"], r["length"], r["index"]) in shared]
    rows = {(r["method"], r["budget"]): r for r in summarise(chosen) if r["task"] == AVERAGE and r["length"] == "all"}
    grouped = by_config(chosen)
    head = ["method", "budget", "variant", "dNLL (95% CI)", "top-1 (95% CI)", "NLL - default (95% CI)", "told?"]
    if not fidelity_only:
        head[3:3] = ["score (95% CI)"]
        head += ["score - default, pts (95% CI)", "told?"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for base in BASES:
        for b in BUDGETS:
            for label, spec in VARIANTS:
                row = rows.get((base + spec, b))
                if row is None:
                    continue
                cells = [
                    _interval(row["nll_increase"], row["nll_increase_ci_low"], row["nll_increase_ci_high"], 3),
                    _interval(row["top1"], row["top1_ci_low"], row["top1_ci_high"], 3),
                ]
                if not fidelity_only:
                    cells.insert(0, _interval(row["score"], row["score_ci_low"], row["score_ci_high"], 1))
                diff = paired_difference(grouped[(base + spec, b)], grouped[(base, b)]) if spec else None
                paired = ["-", ""] if fidelity_only else ["-", "", "-", ""]
                if diff is not None:
                    paired = [
                        _interval(diff["nll_diff"], diff["nll_diff_low"], diff["nll_diff_high"], 3, True),
                        _verdict(diff, "nll_diff_low", "nll_diff_high"),
                    ]
                    if not fidelity_only:
                        paired += [
                            _interval(diff["score_diff"], diff["score_diff_low"], diff["score_diff_high"], 1, True),
                            _verdict(diff, "score_diff_low", "score_diff_high"),
                        ]
                variant = label.replace("|", "\\|")  # the norms' bars would split the markdown cell
                lines.append(f"| {base} | {b} | {variant} | " + " | ".join(cells + paired) + " |")
    per_task: dict[str, int] = {}
    for task, _, _ in shared:
        per_task[task] = per_task.get(task, 0) + 1
    return "\n".join(lines), len(shared), per_task


def render(records: Sequence[dict[str, Any]], out: Path, fidelity_only: bool = False) -> str:
    """The generated block of the doc: sample counts, the table, the command."""
    text, n, per_task = table(records, fidelity_only)
    counts = sorted(set(per_task.values()))
    spread = "/".join(map(str, counts)) if counts else "0"
    return "\n".join(
        [
            START,
            f"Samples: {n} prompts shared by every configuration ({len(per_task)} tasks, {spread} per task), "
            f'1024 tokens, question-aware. "told?": whether the paired 95% interval excludes 0 '
            f'("too few" below {MIN_PAIRED_SAMPLES} paired samples).',
            "",
            text,
            "",
            "Generated by `python benchmarks/ablations.py --out "
            f"{out} --no-run{' --fidelity-only' if fidelity_only else ''} --doc docs/results/ablations.md`.",
            END,
        ]
    )


def write_doc(doc: Path, block: str) -> None:
    """Replace the generated block of ``doc`` (between the markers), or append it."""
    text = doc.read_text() if doc.exists() else ""
    if START in text and END in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text + ("\n" if text else "") + block + "\n"
    doc.write_text(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the sweep's results folder")
    parser.add_argument("--samples", type=int, default=5, help="samples per RULER task (default 5)")
    parser.add_argument("--tasks", default="all", help="RULER tasks, comma-separated (default all 13)")
    parser.add_argument("--doc", type=Path, default=None, help="markdown file to write the table into")
    parser.add_argument(
        "--fidelity-only",
        action="store_true",
        help="generate one token (no task scores): measure the teacher-forced NLL increase and top-1 only",
    )
    parser.add_argument("--no-run", action="store_true", help="only rebuild the table from --out")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if not args.no_run:
        from criticalkv.cli import main as cli

        code = cli(eval_arguments(args.out, args.samples, args.tasks, 1 if args.fidelity_only else 32))
        if code:
            return int(code)
    if not (args.out / "results.jsonl").exists():
        parser.error(f"{args.out} holds no results.jsonl: run without --no-run first")
    block = render(current_results(read_results(args.out)), args.out, args.fidelity_only)
    if args.doc is None:
        print(block)
    else:
        write_doc(args.doc, block)
        logging.getLogger(__name__).info("wrote %s", args.doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
