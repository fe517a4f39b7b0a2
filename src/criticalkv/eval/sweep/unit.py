"""The work of a sweep on one sample: one full prefill, every pending (method, budget) derived from it.

:class:`SampleEvaluator` is built once per (sweep, model) and turns ``(length, sample, pending
pairs)`` into result records. The local runner (:func:`criticalkv.eval.sweep.runner.run_sweep`) and the
Ray workers (:mod:`criticalkv.eval.ray.runner`) both call it, so both produce the same records.
Writing them to ``results.jsonl`` is the caller's job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from criticalkv.budgets.resolve import Budget
from criticalkv.cache import CacheSpec, PromptTooShort
from criticalkv.defaults import DECODE_OPTIONS, STORAGE_OPTIONS
from criticalkv.eval.results import is_done, result_key
from criticalkv.eval.sample import Sample, encode_sample
from criticalkv.eval.sweep.config import row_spec
from criticalkv.eval.sweep.config_rows import Continuation, RowOutcome, decode_configs, reference_logprobs
from criticalkv.eval.sweep.fidelity import Fidelity, fidelity
from criticalkv.eval.tasks.scoring import bind_metric, char_credit
from criticalkv.methods import bind, get_method
from criticalkv.needs import NOTHING
from criticalkv.prompts import left_pad
from criticalkv.runtime import eos_ids, input_device, prompt_states, repeat_prompt

if TYPE_CHECKING:
    from criticalkv.eval.sweep.config import SweepConfig

logger = logging.getLogger(__name__)

Pair = tuple[str, Budget]
#: the full cache's row: every sample's reference
FULL: Pair = ("full", 1.0)

#: tokens generated when neither the sample nor ``--max-new-tokens`` says fewer
DEFAULT_GENERATION_CAP = 128


def record_key(task: str, length: int, index: int, method: str, budget: Budget) -> dict[str, Any]:
    """The fields that identify a result line (see :func:`criticalkv.eval.results.result_key`)."""
    return {"task": task, "length": length, "index": index, "method": method, "budget": budget}


def pending_pairs(sample: Sample, length: int, pairs: Sequence[Pair], done: Mapping[str, str | None]) -> list[Pair]:
    """The (method, budget) pairs of ``sample`` not done on its current content (``done``: result key
    -> content hash, see :func:`criticalkv.eval.results.done_index`)."""
    sha = sample.meta.get("sha256")
    keys = [(m, b, result_key(record_key(sample.task, length, sample.index, m, b))) for m, b in pairs]
    return [(m, b) for m, b, key in keys if not is_done(done, key, sha)]


class SampleTooLong(ValueError):
    """A sample the model cannot run: it needs more positions than the model has, or (reason
    ``too short``) holds fewer tokens than the observation window; ``skip`` is its line for
    ``skipped.jsonl``."""

    def __init__(self, message: str, skip: dict[str, Any]) -> None:
        super().__init__(message)
        self.skip = skip


@dataclass(frozen=True)
class UnitItem:
    """One sample of a work unit, with the pairs still to run on it."""

    length: int
    sample: Sample
    pending: tuple[Pair, ...]

    @property
    def num_records(self) -> int:
        return len(self.pending)


def _skip_line(length: int, sample: Sample, reason: str, **why: Any) -> dict[str, Any]:
    """The ``skipped.jsonl`` line of a sample not run: its key, the reason and what decided it."""
    return {"task": sample.task, "length": length, "index": sample.index, "reason": reason, **why, "meta": sample.meta}


def _gold_text(sample: Sample) -> str:
    if sample.gold is not None:
        return sample.gold
    return (" " if sample.answer_prefix else "") + ", ".join(sample.answers)


class SampleEvaluator:
    """Evaluates samples of one sweep on one model (methods bound and limits checked once).

    Raises ``ValueError`` up front if a configured length plus the generation cap exceeds the
    model's positions.
    """

    def __init__(self, config: SweepConfig, model: Any, tokenizer: Any) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self.cap = config.max_new_tokens or DEFAULT_GENERATION_CAP
        lengths = [] if config.bench.per_sample_length else config.lengths
        if self.limit is not None and any(n + self.cap > self.limit for n in lengths):
            raise ValueError(
                f"the model takes at most {self.limit} positions; lower --lengths (generation needs {self.cap} more)"
            )
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        # inputs go where the embeddings are (the first device when a model is sharded)
        self.device = input_device(model)
        self.eos = eos_ids(model, tokenizer)
        self.window = int(config.window or 0)
        precision = config.norm_precision
        self.methods = {
            name: bind(get_method(name).with_norm_precision(precision), model, config.head_scores)
            for name in {"full", *config.methods}
        }
        needs = NOTHING
        for bound in self.methods.values():
            needs = needs.merge(bound.needs)
        #: what the prefill keeps for every method of the unit (queries; KVzip's reconstruction pass, once)
        self.needs = needs
        #: the sweep's spec, its storage checked against the model (a group size must divide its head dimension)
        self.template = config.spec(model.config)
        #: whether the compressed rows are held at a decode budget while they decode
        self.held = self.template.decode is not None
        self._specs: dict[Pair, CacheSpec] = {}
        #: the decode budget and interval in each record of a row held at it while it decodes
        self.decode_fields = {k: v for k, v in config.cache.items() if k in DECODE_OPTIONS}
        #: the storage options in each record, as given (the group size and residual only when given)
        self.storage_fields = {k: v for k, v in config.cache.items() if k in STORAGE_OPTIONS}
        self.repeat = repeat_prompt(tokenizer, config.chat)

    def spec(self, pair: Pair) -> CacheSpec:
        """The spec of a (method, budget) row: its bound method at its budget, with the sweep's
        decode budget and storage (:func:`~criticalkv.eval.sweep.config.row_spec`)."""
        if pair not in self._specs:
            self._specs[pair] = row_spec(self.template, self.methods[pair[0]], pair[1])
        return self._specs[pair]

    def run_or_skip(
        self, length: int, sample: Sample, pending: Sequence[Pair]
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(records, skipped)``: :meth:`run`, or, for a benchmark whose samples have their own
        length, no records and the sample's ``skipped.jsonl`` line if it is longer than the model accepts."""
        try:
            return self.run(length, sample, pending), []
        except SampleTooLong as error:
            if not self.config.bench.per_sample_length:
                raise
            logger.warning("skipping a sample: %s", error)
            return [], [error.skip]

    @torch.no_grad()
    def run(self, length: int, sample: Sample, pending: Sequence[Pair]) -> list[dict[str, Any]]:
        """Result records of ``pending`` on ``sample``, in the order of ``pending`` (``full`` first if pending)."""
        if not pending:
            return []
        config, model, tokenizer = self.config, self.model, self.tokenizer
        ctx, qst = encode_sample(tokenizer, sample, config.chat)
        gold = list(tokenizer(_gold_text(sample), add_special_tokens=False)["input_ids"])
        aware = config.mode == "question-aware"
        prompt = ctx + qst if aware else ctx
        self._check_fits(length, sample, len(ctx) + len(qst) + max(min(sample.max_new_tokens, self.cap), len(gold)))
        self._check_window(length, sample, len(prompt), pending)
        ids, mask = left_pad([prompt], self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        started = time.perf_counter()
        states, last_logits = prompt_states(
            model, ids, mask, self.needs, window=self.window, reconstruction=self.repeat
        )
        prefill_s = time.perf_counter() - started
        after = Continuation(
            ids=ids,
            mask=mask,
            last_logits=last_logits,
            question=[] if aware else list(qst),
            suffix=gold if aware else qst + gold,
            answer_len=len(gold),
            max_new_tokens=min(sample.max_new_tokens, self.cap),
            aware=aware,
        )
        # the full-cache reference first, then every pending config
        rows = [FULL, *(p for p in pending if p != FULL)]
        specs = [self.spec(pair) for pair in rows]
        outcomes = decode_configs(model, tokenizer, self.eos, self.pad_id, states, after, specs, held=self.held)
        # quantized rows are measured against the unquantized full cache
        full = self.methods["full"]
        quantized = specs[0].storage is not None
        reference = reference_logprobs(model, states, after, full) if quantized else outcomes[0].logprobs
        shared = {"mode": config.mode, "context_tokens": len(ctx), "prompt_tokens": len(prompt), "prefill_s": prefill_s}
        return [
            self._record(length, sample, pair, outcomes[row], fidelity(outcomes[row].logprobs, reference, gold), shared)
            for row, pair in enumerate(rows)
            if row > 0 or FULL in pending
        ]

    def _check_fits(self, length: int, sample: Sample, positions_needed: int) -> None:
        """:class:`SampleTooLong` if the prompt, chat template and answer need more positions than the model has."""
        if self.limit is None or positions_needed <= self.limit:
            return
        what = f"{sample.task} sample {sample.index} needs {positions_needed} positions (prompt, chat template "
        advice = "shorten it" if self.config.bench.per_sample_length else "lower --lengths"
        raise SampleTooLong(
            f"{what}and answer), more than the model's {self.limit}; {advice}",
            _skip_line(length, sample, "too long", positions=positions_needed, limit=self.limit),
        )

    def _check_window(self, length: int, sample: Sample, compressed: int, pending: Sequence[Pair]) -> None:
        """:class:`SampleTooLong` (reason ``too short``) if the spec of some pending row cannot
        compress the prompt (:meth:`CacheSpec.check_compressible`: its budget cannot hold the
        observation window, or exceeds the prompt)."""
        for pair in pending:
            try:
                self.spec(pair).check_compressible(compressed)
            except PromptTooShort as error:
                raise SampleTooLong(
                    f"{sample.task} sample {sample.index}: {error}",
                    _skip_line(length, sample, "too short", tokens=compressed, window=self.window),
                ) from None

    def _record(
        self, length: int, sample: Sample, pair: Pair, done: RowOutcome, fid: Fidelity, shared: dict[str, Any]
    ) -> dict[str, Any]:
        """One result line: the config's answer, its score, fidelity, memory and times."""
        method, budget = pair
        answer = done.answer
        extra = {} if done.kv_bytes_peak is None else {"kv_bytes_peak": done.kv_bytes_peak, **self.decode_fields}
        return {
            **record_key(sample.task, length, sample.index, method, budget),
            "mode": shared["mode"],
            "metric": sample.metric,
            "score": bind_metric(sample)(answer, sample.answers),
            "partial": char_credit(answer, sample.answers),
            "nll": fid.nll,
            "kl": fid.kl,
            "top1": fid.top1,
            "prediction": answer,
            "answers": sample.answers,
            "context_tokens": shared["context_tokens"],
            "prompt_tokens": shared["prompt_tokens"],
            "kv_bytes": done.kv_bytes,
            "kv_bytes_full": done.kv_bytes_full,
            "prefill_s": shared["prefill_s"],
            "compress_s": done.compress_s,
            "batch_decode_s": done.decode_s,
            "batch_rows": done.batch_rows,
            "new_tokens": done.new_tokens,
            **extra,
            **self.storage_fields,
            "meta": sample.meta,
        }
