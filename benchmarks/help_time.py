"""How long ``criticalkv --help`` and each subcommand's ``--help`` take, beside importing torch.

Each is a fresh process (``python -m criticalkv.cli ... --help``, the installed command minus its
launcher), timed wall-clock; the median and the minimum over ``--repeats`` runs. Beside them, the
same interpreter running ``import torch, transformers``: what every ``--help`` paid before the
command line imported its heavy modules lazily (issue 29).

Run: ``PYTHONPATH=src python benchmarks/help_time.py [--repeats 5] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from criticalkv.cli import COMMANDS


def wall(command: list[str], repeats: int) -> dict[str, float]:
    """Median and minimum wall-clock seconds of ``command`` over ``repeats`` fresh processes."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=os.environ)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per command (default 5)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "criticalkv.cli"]
    rows = {"criticalkv --help": wall([*cli, "--help"], args.repeats)}
    for module in COMMANDS:
        rows[f"criticalkv {module.NAME} --help"] = wall([*cli, module.NAME, "--help"], args.repeats)
    rows["python -c 'import torch, transformers'"] = wall(
        [sys.executable, "-c", "import torch, transformers"], args.repeats
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if args.json:
        print(json.dumps({"rows": rows, "repeats": args.repeats, "load_1min": load, "cores": os.cpu_count()}))
        return
    print(f"{args.repeats} fresh processes each; load average {load} on {os.cpu_count()} cores")
    heavy = rows["python -c 'import torch, transformers'"]["median_s"]
    for name, row in rows.items():
        ratio = row["median_s"] / heavy
        print(f"{name:<42} median {row['median_s']:.3f} s  min {row['min_s']:.3f} s  ({ratio:.2f}x torch)")


if __name__ == "__main__":
    main()
