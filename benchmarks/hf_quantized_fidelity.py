"""transformers' own ``QuantizedCache`` (HQQ by default) on the RULER samples of a ``criticalkv eval``
sweep: fidelity to the full cache and real bytes, beside our quantized cache.

    PYTHONPATH=src python benchmarks/hf_quantized_fidelity.py OUT.jsonl --tasks niah_single_1,qa_1 \
        --lengths 1024 --samples 8 --max-new-tokens 16 [--bits 8,4] [--backend hqq] [--residual 64]

The samples, their encoding (chat template, question-aware), the gold answer and the metrics are
eval's (:class:`~criticalkv.eval.sweep.config.SweepConfig`, ``encode_sample``,
:func:`~criticalkv.runtime.teacher_forced_logprobs`, :func:`~criticalkv.eval.sweep.fidelity.fidelity`,
``bind_metric``), so each line pairs with eval's record of the same (task, length, index). Per
sample: one prefill into a ``DynamicCache`` (the reference: the gold answer teacher-forced on the
full cache), then for each bit width transformers' ``QuantizedCache`` filled by its own
``update`` with the prompt's states (what its first ``update`` does during a prefill: it
quantizes them all), the gold answer teacher-forced on it (KL and top-1 against the full
cache), and a greedy answer by ``model.generate`` on a second such cache (the score). Nothing is
evicted: ``kv_bytes`` is its quantized prompt (codes, scales, zero points) and
``bits_per_element`` ``32 * kv_bytes / kv_bytes_full``. The group size is ours at that width
(``--group``: 32 at 8 bits, 64 at 4 bits by default); appended tokens stay exact until
``--residual`` of them are held.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from criticalkv.bench.hf_quantized import hf_quantized_cache
from criticalkv.bench.ours import dynamic_cache_bytes
from criticalkv.cache.quantized import default_group_size
from criticalkv.eval.sample import Sample, encode_sample
from criticalkv.eval.sweep import SweepConfig, fidelity
from criticalkv.eval.sweep.unit import _gold_text  # the gold answer eval teacher-forces: the same rule
from criticalkv.eval.tasks import bind_metric
from criticalkv.prompts import left_pad
from criticalkv.runtime import continue_generation, decode_answers, eos_ids, prefill_into, teacher_forced_logprobs


def filled(model: Any, states: Sequence[tuple[torch.Tensor, torch.Tensor]], backend: str, bits: int, group: int,
           residual: int) -> Any:  # fmt: skip
    """A ``QuantizedCache`` holding the prompt's (keys, values) of every layer, quantized by its own ``update``."""
    cache = hf_quantized_cache(model, backend, bits, group, residual)
    for layer, (keys, values) in enumerate(states):
        cache.update(keys, values, layer)
    return cache


@torch.no_grad()
def sample_records(
    model: Any,
    tokenizer: Any,
    length: int,
    sample: Sample,
    *,
    bits: Sequence[int],
    backend: str = "hqq",
    groups: dict[int, int] | None = None,
    residual: int = 64,
    max_new_tokens: int = 16,
    chat: bool = True,
) -> list[dict[str, Any]]:
    """One record per bit width for ``sample`` (question-aware, batch 1), plus the full cache's (``kv_bits`` 32)."""
    ctx, qst = encode_sample(tokenizer, sample, chat)
    gold = list(tokenizer(_gold_text(sample), add_special_tokens=False)["input_ids"])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask = left_pad([ctx + qst], pad)
    full = DynamicCache(config=model.config)
    last = prefill_into(model, full, ids, mask)
    states = [(layer.keys.clone(), layer.values.clone()) for layer in full.layers]
    full_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in states)
    reference = teacher_forced_logprobs(model, full, mask, gold, len(gold), last)[0]
    eos, metric, cap = eos_ids(model, tokenizer), bind_metric(sample), min(sample.max_new_tokens, max_new_tokens)
    key = {"task": sample.task, "length": length, "index": sample.index, "answers": sample.answers}

    def answer(cache: Any) -> str:
        generated = continue_generation(model, cache, ids, mask, last.argmax(-1), cap, pad_token_id=pad)
        return decode_answers(tokenizer, generated, eos)[0][0]

    plain = DynamicCache(config=model.config)
    for layer, (k, v) in enumerate(states):
        plain.update(k, v, layer)
    text = answer(plain)
    records = [{**key, "kv_bits": 32, "backend": "full", "nll": fidelity(reference, reference, gold).nll, "kl": 0.0,
                "top1": 1.0, "kv_bytes": full_bytes, "kv_bytes_full": full_bytes, "bits_per_element": 32.0,
                "prediction": text, "score": metric(text, sample.answers)}]  # fmt: skip
    for b in bits:
        group = (groups or {}).get(b, default_group_size(b))
        cache = filled(model, states, backend, b, group, residual)
        kv_bytes = dynamic_cache_bytes(cache)
        logprobs = teacher_forced_logprobs(model, cache, mask, gold, len(gold), last)[0]
        fid = fidelity(logprobs, reference, gold)
        text = answer(filled(model, states, backend, b, group, residual))
        records.append(
            {**key, "kv_bits": b, "backend": backend, "q_group_size": group, "residual_length": residual,
             "nll": fid.nll, "kl": fid.kl, "top1": fid.top1, "kv_bytes": kv_bytes, "kv_bytes_full": full_bytes,
             "bits_per_element": 32 * kv_bytes / full_bytes, "prediction": text,
             "score": metric(text, sample.answers)}
        )  # fmt: skip
    return records


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="JSONL file to write (appended; samples already in it are skipped)")
    p.add_argument("--tasks", default="niah_single_1,qa_1")
    p.add_argument("--lengths", default="1024")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--bits", default="8,4")
    p.add_argument("--backend", default="hqq", choices=["hqq", "quanto"])
    p.add_argument("--residual", type=int, default=64)
    p.add_argument("--model", default="default")
    args = p.parse_args(argv)
    from criticalkv.models import load_model

    config = SweepConfig(
        out=args.out.parent / "sweep-unused",
        tasks=args.tasks.split(","),
        lengths=[int(n) for n in args.lengths.split(",")],
        methods=["full"],
        samples=args.samples,
        max_new_tokens=args.max_new_tokens,
    )
    model, tokenizer = load_model(args.model)
    bits = [int(b) for b in args.bits.split(",")]
    done = set()
    if args.out.exists():
        done = {(r["task"], r["length"], r["index"]) for r in map(json.loads, args.out.read_text().splitlines())}
    for length, sample in config.iter_samples(tokenizer):
        if (sample.task, length, sample.index) in done:
            continue
        records = sample_records(
            model, tokenizer, length, sample, bits=bits, backend=args.backend, residual=args.residual,
            max_new_tokens=int(config.max_new_tokens or 16),
        )  # fmt: skip
        with args.out.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(json.dumps({k: records[-1][k] for k in ("task", "index", "kv_bits", "nll", "kl", "top1")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
