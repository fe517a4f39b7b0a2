"""Table and Pareto chart of eviction x quantization from ``criticalkv eval`` folders.

    PYTHONPATH=src python benchmarks/quantized_storage_report.py OUT BITS16_DIR BITS8_DIR BITS4_DIR

Each folder is one sweep over the same samples (same tasks, lengths, samples, seed) at one
``--kv-bits``. The NLL increase is measured against the *unquantized* full cache of the 16-bit
folder, sample by sample (the quantized folders' ``full`` rows are quantization only). Bits per
element of the compressed prompt: ``32 * kv_bytes / kv_bytes`` of the 16-bit (float32) folder's
row of the same sample and budget, which keeps the same entries (the selection runs before storage).
Writes ``OUT/summary.csv`` and ``OUT/pareto.png``; prints the table.
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean

from criticalkv.plotting import pyplot


def load(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]


def main() -> None:
    out, folders = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:5]]
    out.mkdir(parents=True, exist_ok=True)
    reference = {(r["task"], r["index"]): r["nll"] for r in load(folders[0]) if r["method"] == "full"}
    unquantized = {(r["task"], r["index"], r["method"], float(r["budget"])): r["kv_bytes"] for r in load(folders[0])}
    groups: dict[tuple[int, str, float], list[dict]] = defaultdict(list)
    for bits, folder in zip((16, 8, 4), folders, strict=True):
        for r in load(folder):
            groups[(bits, r["method"], float(r["budget"]))].append(r)
    rows = []
    for (bits, method, budget), records in sorted(groups.items()):
        rows.append(
            {
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
        )
    with (out / "summary.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for bits, marker in ((16, "o"), (8, "s"), (4, "^")):
        points = sorted((r["kv_ratio"], r["nll_increase"]) for r in rows if r["kv_bits"] == bits)
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker=marker,
            label=f"{bits if bits < 16 else 32}-bit storage",
        )
    ax.set_xscale("log")
    ax.set_xlabel("KV bytes / full float32 cache")
    ax.set_ylabel("NLL increase (nats/token) vs full cache")
    ax.set_title("critical-adakv: eviction x quantization (default model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
