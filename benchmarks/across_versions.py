"""Checks that a change kept what must stay true: run with one checkout, then with another.

Three jobs, each printing what it compares (the cache redesign's page,
docs/results/redesign.md, has the commands and the numbers they printed):

* ``cache-file save FOLDER`` / ``cache-file load FOLDER``: compress a prompt with critical-adakv at
  budget 0.2 in 16 and 4 bits, save the caches and the logits of a question asked of them (``save``,
  with the older checkout); load the files and ask again (``load``, with the newer one), beside a
  fresh compression, and print the largest logit difference. A refusal prints its sentence.
* ``bench --before FOLDER... --after FOLDER...``: pool ``criticalkv bench`` folders per tree by configuration
  (method, storage): best and median compress s and decode ms/token, best TTFT, and whether the KV
  bytes and greedy tokens agree across every run.
* ``records OLD NEW --key task,index,method,budget``: match the JSON lines of NEW to OLD by the key
  and count equal ``--fields`` (default ``prediction``, ``score``, ``kv_bytes``) and the largest ``nll``
  change where both records have one; exit 1 unless every matched record agrees.

Run a checkout's own code with ``PYTHONPATH=src`` from its folder.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

QUESTION = " Who signed the report? Answer:"


def _cache_file(mode: str, folder: Path, context: Path, tokens: int) -> None:
    import torch

    import criticalkv as ckv
    from criticalkv.compat import cache_argument
    from criticalkv.models.loading import load_model
    from criticalkv.prompts import positions

    model, tokenizer = load_model()
    model = ckv.attach(model)
    ids = torch.tensor([tokenizer(context.read_text())["input_ids"][:tokens]])
    mask = torch.ones_like(ids)
    question = torch.tensor([tokenizer(QUESTION)["input_ids"]])

    def fresh(bits: int) -> Any:
        cache = ckv.CompressedCache.for_model(model, "critical-adakv", 0.2, kv_bits=bits)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), **cache_argument(model, cache))
        return cache

    def ask(cache: Any) -> torch.Tensor:
        full = torch.ones(1, ids.shape[1] + question.shape[1], dtype=torch.long)
        with torch.no_grad():
            out = model(
                input_ids=question,
                attention_mask=full,
                position_ids=positions(full)[:, -question.shape[1] :],
                **cache_argument(model, cache),
            )
        return out.logits

    folder.mkdir(parents=True, exist_ok=True)
    for bits in (16, 4):
        path, logits_path = folder / f"cache-{bits}.ckv", folder / f"logits-{bits}.pt"
        if mode == "save":
            cache = fresh(bits)
            size = cache.save(path, model, tokenizer)
            torch.save(ask(cache), logits_path)
            print(f"{bits}-bit: saved {size} bytes to {path}")
            continue
        saved = torch.load(logits_path)
        try:
            loaded = ckv.CompressedCache.load(path, model, tokenizer)
        except Exception as error:  # the refusal's sentence is the result
            print(f"{bits}-bit: refused: {type(error).__name__}: {error}")
            continue
        now, again = ask(loaded), ask(fresh(bits))
        print(
            f"{bits}-bit: loaded; max |logit diff| vs the saved run {float((now - saved).abs().max()):.3g}; "
            f"a fresh compression now vs the saved run {float((again - saved).abs().max()):.3g}; "
            f"same argmax: {bool(torch.equal(now.argmax(-1), saved.argmax(-1)))}"
        )


def _bench_records(folders: Sequence[Path]) -> dict[str, list[dict[str, Any]]]:
    pooled: dict[str, list[dict[str, Any]]] = {}
    for folder in folders:
        for line in (folder / "records.jsonl").read_text().splitlines():
            record = json.loads(line)
            storage = f" {record['kv_bits']}-bit" if record.get("kv_bits") else ""
            pooled.setdefault(record["method"] + storage, []).append(record)
    return pooled


def _best_median(records: Sequence[dict[str, Any]], field: str) -> str:
    values = [float(r[field]) for r in records]
    return f"{min(values):.3f} / {statistics.median(values):.3f}"


def _bench(before: Sequence[Path], after: Sequence[Path]) -> None:
    old, new = _bench_records(before), _bench_records(after)
    print("| configuration | runs | compress s, best / median | decode ms/token, best / median | best TTFT s |")
    print("|---|---|---|---|---|")
    for name in old:
        if name not in new:
            continue
        a, b = old[name], new[name]
        same_bytes = {r["kv_bytes"] for r in a} == {r["kv_bytes"] for r in b}
        same_tokens = len({json.dumps(r["greedy_tokens"]) for r in [*a, *b]}) == 1
        print(
            f"| {name} | {len(a)} -> {len(b)} | {_best_median(a, 'compress_s')} -> {_best_median(b, 'compress_s')} "
            f"| {_best_median(a, 'decode_ms_per_token')} -> {_best_median(b, 'decode_ms_per_token')} "
            f"| {min(r['ttft_s'] for r in a):.2f} -> {min(r['ttft_s'] for r in b):.2f} |"
            f"{'' if same_bytes else ' KV BYTES DIFFER'}{'' if same_tokens else ' TOKENS DIFFER'}"
        )


def _records(old_path: Path, new_path: Path, key: Sequence[str], fields: Sequence[str]) -> int:
    old = {tuple(r[k] for k in key): r for r in map(json.loads, old_path.read_text().splitlines())}
    equal = dict.fromkeys(fields, 0)
    matched, nll_change = 0, 0.0
    for record in map(json.loads, new_path.read_text().splitlines()):
        before = old.get(tuple(record[k] for k in key))
        if before is None:
            print("not in OLD:", [record[k] for k in key])
            continue
        matched += 1
        for field in fields:
            equal[field] += before.get(field) == record.get(field)
        if "nll" in before and "nll" in record:
            nll_change = max(nll_change, abs(float(before["nll"]) - float(record["nll"])))
    print(f"{matched} records matched; equal: {equal}; max |nll change| {nll_change:.3g}")
    return 0 if matched and all(count == matched for count in equal.values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    jobs = parser.add_subparsers(dest="job", required=True)
    cache_file = jobs.add_parser("cache-file", help="save with one checkout, load with another")
    cache_file.add_argument("mode", choices=("save", "load"))
    cache_file.add_argument("folder", type=Path)
    cache_file.add_argument("--context", type=Path, default=Path("docs/results/redesign/context.txt"))
    cache_file.add_argument("--tokens", type=int, default=1200, help="prompt tokens taken from --context")
    bench = jobs.add_parser("bench", help="pool criticalkv bench folders of two trees")
    bench.add_argument("--before", nargs="+", type=Path, required=True, help="the older checkout's folders")
    bench.add_argument("--after", nargs="+", type=Path, required=True, help="the newer checkout's folders")
    records = jobs.add_parser("records", help="match JSON lines of NEW to OLD by --key")
    records.add_argument("old", type=Path)
    records.add_argument("new", type=Path)
    records.add_argument("--key", default="task,index,method,budget", help="fields that name a record")
    records.add_argument("--fields", default="prediction,score,kv_bytes", help="fields that must be equal")
    args = parser.parse_args(argv)
    if args.job == "cache-file":
        _cache_file(args.mode, args.folder, args.context.resolve(), args.tokens)
        return 0
    if args.job == "records":
        return _records(args.old, args.new, args.key.split(","), args.fields.split(","))
    _bench(args.before, args.after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
