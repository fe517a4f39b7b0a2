"""Table and Pareto chart of eviction x quantization from ``criticalkv eval`` folders.

    PYTHONPATH=src python benchmarks/quantized_storage_report.py OUT BITS16_DIR BITS8_DIR BITS4_DIR \
        [--hf HF_RECORDS.jsonl]

Each folder is one sweep over the same samples (same tasks, lengths, samples, seed) at one
``--kv-bits``. The NLL increase is measured against the *unquantized* full cache of the 16-bit
folder, sample by sample (the quantized folders' ``full`` rows are quantization only). Bits per
element of the compressed prompt: ``32 * kv_bytes / kv_bytes`` of the 16-bit (float32) folder's
row of the same sample and budget, which keeps the same entries (the selection runs before storage).
``quantized - float32``: the paired NLL difference of each quantized row and the float32 row of the
same sample, method and budget, with its 95% percentile bootstrap interval
(:func:`criticalkv.eval.report.bootstrap.paired_difference`). ``--hf``: the records of
``benchmarks/hf_quantized_fidelity.py`` (transformers' ``QuantizedCache``, no eviction, on the same
samples) as one more series, its NLL increase against the same float32 full cache.
Writes ``OUT/summary.csv`` and ``OUT/pareto.png``; prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any

from criticalkv.eval.report import by_config, paired_difference
from criticalkv.plotting import pyplot


def load(path: Path) -> list[dict[str, Any]]:
    """The records of an eval folder (its ``results.jsonl``) or of a JSONL file."""
    file = path / "results.jsonl" if path.is_dir() else path
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


def ours(folders: list[Path]) -> list[dict[str, Any]]:
    """One row per (kv_bits, method, budget) of the three eval sweeps."""
    plain = load(folders[0])
    reference = {(r["task"], r["index"]): r["nll"] for r in plain if r["method"] == "full"}
    unquantized = {(r["task"], r["index"], r["method"], float(r["budget"])): r["kv_bytes"] for r in plain}
    float32 = by_config(plain)
    groups: dict[tuple[int, str, float], list[dict[str, Any]]] = defaultdict(list)
    for bits, folder in zip((16, 8, 4), folders, strict=True):
        for r in load(folder):
            groups[(bits, r["method"], float(r["budget"]))].append(r)
    rows = []
    for (bits, method, budget), records in sorted(groups.items()):
        row: dict[str, Any] = {
            "series": "criticalkv",
            "kv_bits": bits,
            "method": method,
            "budget": budget,
            "n": len(records),
            "kv_ratio": round(mean(r["kv_bytes"] / r["kv_bytes_full"] for r in records), 5),
            "kv_bytes": round(mean(r["kv_bytes"] for r in records)),
            "bits_per_element": round(
                mean(32 * r["kv_bytes"] / unquantized[(r["task"], r["index"], method, budget)] for r in records), 4
            ),
            "nll_increase": round(mean(r["nll"] - reference[(r["task"], r["index"])] for r in records), 4),
            "kl": round(mean(r["kl"] for r in records), 4),
            "top1": round(mean(r["top1"] for r in records), 3),
            "score": round(100 * mean(r["score"] for r in records), 1),
        }
        if bits != 16:
            diff = paired_difference(by_config(records)[(method, budget)], float32[(method, budget)])
            if diff is not None:
                row["nll_vs_float32"] = round(diff["nll_diff"], 4)
                row["nll_vs_float32_low"] = round(diff["nll_diff_low"], 4)
                row["nll_vs_float32_high"] = round(diff["nll_diff_high"], 4)
        rows.append(row)
    return rows


def hf_rows(path: Path, reference_folder: Path) -> list[dict[str, Any]]:
    """One row per bit width of transformers' ``QuantizedCache`` records (no eviction, budget 1.0)."""
    plain = load(reference_folder)
    reference = {(r["task"], r["index"]): r for r in plain if r["method"] == "full"}
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in load(path):
        if r["kv_bits"] != 32 and (r["task"], r["index"]) in reference:
            groups[int(r["kv_bits"])].append(r)
    rows = []
    for bits, records in sorted(groups.items(), reverse=True):
        paired = {(r["task"], r["length"], r["index"]): r for r in records}
        base = {(r["task"], r["length"], r["index"]): r for r in plain if r["method"] == "full"}
        diff = paired_difference(paired, base)
        if diff is None:  # records are kept only for samples the float32 folder has
            raise ValueError(f"{path}: no sample in common with {reference_folder}")
        rows.append(
            {
                "series": f"transformers-{records[0]['backend']}",
                "kv_bits": bits,
                "method": "full",
                "budget": 1.0,
                "n": len(records),
                "kv_ratio": round(mean(r["kv_bytes"] / r["kv_bytes_full"] for r in records), 5),
                "kv_bytes": round(mean(r["kv_bytes"] for r in records)),
                "bits_per_element": round(mean(r["bits_per_element"] for r in records), 4),
                "nll_increase": round(mean(r["nll"] - reference[(r["task"], r["index"])]["nll"] for r in records), 4),
                "kl": round(mean(r["kl"] for r in records), 4),
                "top1": round(mean(r["top1"] for r in records), 3),
                "score": round(100 * mean(r["score"] for r in records), 1),
                "nll_vs_float32": round(diff["nll_diff"], 4),
                "nll_vs_float32_low": round(diff["nll_diff_low"], 4),
                "nll_vs_float32_high": round(diff["nll_diff_high"], 4),
            }
        )
    return rows


def chart(rows: list[dict[str, Any]], out: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for bits, marker in ((16, "o"), (8, "s"), (4, "^")):
        points = sorted(
            (r["kv_ratio"], r["nll_increase"]) for r in rows if r["series"] == "criticalkv" and r["kv_bits"] == bits
        )
        label = f"criticalkv {bits if bits < 16 else 32}-bit storage"
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, label=label)
    for r in rows:
        if r["series"] != "criticalkv":
            marker = "D" if r["kv_bits"] == 8 else "v"
            label = f"{r['series']} QuantizedCache {r['kv_bits']}-bit (no eviction)"
            ax.plot([r["kv_ratio"]], [r["nll_increase"]], marker=marker, linestyle="none", color="black", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes / full float32 cache")
    ax.set_ylabel("NLL increase (nats/token) vs full cache")
    ax.set_title("critical-adakv: eviction x quantization (default model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("folders", type=Path, nargs=3, help="the 16-bit, 8-bit and 4-bit eval folders")
    p.add_argument("--hf", type=Path, default=None, help="benchmarks/hf_quantized_fidelity.py records")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = ours(list(args.folders))
    if args.hf is not None:
        rows += hf_rows(args.hf, args.folders[0])
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with (args.out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    chart(rows, args.out)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
