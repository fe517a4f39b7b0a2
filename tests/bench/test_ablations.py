"""benchmarks/ablations.py: the method specs it sweeps and its paired table on a synthetic folder."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import criticalkv as ckv
from criticalkv.commands.common import methods_arg


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ablations.py"
    spec = importlib.util.spec_from_file_location("ablations_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ablations = _load()


def _record(method: str, budget: float, task: str, index: int, nll: float) -> dict[str, Any]:
    return {
        "task": task, "length": 1024, "index": index, "method": method, "budget": budget, "score": 0.0,
        "partial": 0.0, "nll": nll, "kl": 0.0, "top1": 1.0, "kv_bytes": 1, "kv_bytes_full": 4,
    }  # fmt: skip


def test_every_swept_spec_is_a_valid_method() -> None:
    specs = methods_arg(",".join(ablations.methods()))
    assert len(specs) == 1 + len(ablations.BASES) * len(ablations.VARIANTS)
    assert ckv.get_method("critical-adakv:projected=false").select.projected is False  # type: ignore[attr-defined]
    args = ablations.eval_arguments(Path("out"), 3, "qa_1", 1)
    assert args[args.index("--max-new-tokens") + 1] == "1" and args[args.index("--samples") + 1] == "3"


def test_table_pairs_each_variant_with_the_default_on_shared_samples(tmp_path: Path) -> None:
    records = []
    for task in ("a", "b"):
        for i in range(6):
            records.append(_record("full", 1.0, task, i, 1.0))
            for base in ablations.BASES:
                for _, spec in ablations.VARIANTS:
                    for b in ablations.BUDGETS:
                        worse = 0.5 if spec == ":eps=0" else 0.0  # eps=0 raises the NLL by 0.5 everywhere
                        records.append(_record(base + spec, b, task, i, 2.0 + worse + 0.01 * i))
    records.append(_record("critical-snapkv", 0.1, "a", 99, 5.0))  # a sample no variant has: left out
    text, n, per_task = ablations.table(records, fidelity_only=True)
    assert n == 12 and per_task == {"a": 6, "b": 6}
    eps0 = [line for line in text.splitlines() if "| critical-snapkv | 0.1 | eps = 0 |" in line]
    assert len(eps0) == 1 and "+0.500 [+0.500, +0.500] | yes |" in eps0[0]
    default = next(line for line in text.splitlines() if "| critical-snapkv | 0.1 | default" in line)
    assert "1.025 [" in default and "\\|\\|V W_O\\|\\|_1" in default  # dNLL: mean of 1 + 0.01 i; escaped bars
    plain = next(line for line in text.splitlines() if "| critical-adakv | 0.4 | plain" in line)
    assert "+0.000 [+0.000, +0.000] | no |" in plain
    doc = tmp_path / "doc.md"
    doc.write_text("intro\n" + ablations.START + "\nSTALE BLOCK\n" + ablations.END + "\noutro\n")
    ablations.write_doc(doc, ablations.render(records, Path("F"), fidelity_only=True))
    written = doc.read_text()
    assert written.startswith("intro\n") and written.endswith("\noutro\n") and "STALE BLOCK" not in written
    assert "--fidelity-only" in written and "12 prompts" in written
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert ablations.main(["--out", str(tmp_path / "run"), "--no-run", "--fidelity-only", "--doc", str(doc)]) == 0
