"""Computing head importance scores from needle-retrieval runs (HeadKV's retrieval heads): the
model-running half of the head scores (``criticalkv head-scores``), above the runtime; the files it
writes and their binding to a method are :mod:`criticalkv.headscores`, below it.

The procedure, for a model and :class:`ScoringParameters`:

1. For every context length in ``lengths`` and each of ``depths`` needle depths evenly spaced
   in [0, 1], build a needle-retrieval sample (:func:`~criticalkv.headscores.needles.make_retrieval_sample`,
   seed ``seed + i`` for the ``i``-th sample): a haystack with one needle sentence holding a
   7-digit number, the question, and an answer prefix; the number's tokens follow (teacher
   forcing).
2. Run one forward pass. For each answer token ``a_j``, the query that produces it (the
   token before it) is softmaxed over all keys it sees, in float32, for every (layer, query
   head). The logits say whether greedy decoding would produce ``a_j``; a sample counts if
   the share of answer tokens produced is at least ``min_accuracy`` (1.0: the model retrieves
   the whole number; HeadKV keeps samples with an F1 above 50).
3. Per counted sample and head, two scores, each averaged over the answer tokens:

   * ``retrieval`` (Wu et al. 2024, arXiv 2404.15574): 1 if the head's most attended position
     lies in the needle and holds the very token being produced (the head copies it), else 0.
   * ``retrieval-reasoning`` (Fu et al. 2024, HeadKV, arXiv 2410.19258, Sec. 3.1): the
     attention mass the head puts on needle positions among its top-``k`` positions, with ``k``
     the needle's length in tokens, whether or not they hold the produced token. (HeadKV also
     multiplies by 10 and divides by ``k``: a near-constant factor that the normalisation of
     the budgets removes.)

4. A head's score is the mean over the counted samples; a KV head's, the mean over the query
   heads of its GQA group. HeadKV's budgets use ``retrieval-reasoning``, normalised over all
   heads of the model.

HeadKV scores on reasoning needles (question and needle phrased differently); the small
default model cannot solve those, so both variants here use the verbatim needle: the
``retrieval-reasoning`` variant differs by its scoring rule (attention mass on the needle
rather than exact copying).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

import torch
from tqdm.auto import tqdm

from criticalkv.headscores import HeadScores, architecture, make_retrieval_sample
from criticalkv.headscores import model_name as name_of
from criticalkv.runs import versions
from criticalkv.runtime.attach import attach
from criticalkv.runtime.forward import capture_prefill, input_device
from criticalkv.state import LayerState

logger = logging.getLogger(__name__)

RETRIEVAL = "retrieval"
RETRIEVAL_REASONING = "retrieval-reasoning"
VARIANTS: tuple[str, ...] = (RETRIEVAL_REASONING, RETRIEVAL)
REFERENCES = {
    RETRIEVAL: "Wu et al. 2024, Retrieval Head Mechanistically Explains Long-Context Factuality (arXiv 2404.15574)",
    RETRIEVAL_REASONING: "Fu et al. 2024, Not All Heads Matter / HeadKV (arXiv 2410.19258), Sec. 3.1",
}


@dataclass(frozen=True)
class ScoringParameters:
    """Parameters of the head-scoring procedure (see the module docstring).

    Parameters
    ----------
    lengths : context lengths in tokens (HeadKV: 1K to 50K; the default keeps a CPU run short).
    depths : number of needle depths, evenly spaced in [0, 1] (HeadKV: 10).
    seed : seed of the first sample (keys and numbers are drawn from it).
    min_accuracy : share of answer tokens greedy decoding must produce for a sample to count.
    chat : wrap the prompt in the tokenizer's chat template.
    """

    lengths: tuple[int, ...] = (1024, 2048)
    depths: int = 10
    seed: int = 0
    min_accuracy: float = 1.0
    chat: bool = True

    def __post_init__(self) -> None:
        if not self.lengths or any(isinstance(n, bool) or not isinstance(n, int) or n < 64 for n in self.lengths):
            raise ValueError(f"lengths must be context lengths of at least 64 tokens, not {self.lengths!r}")
        if isinstance(self.depths, bool) or not isinstance(self.depths, int) or self.depths < 1:
            raise ValueError(f"depths must be a positive number of needle depths, not {self.depths!r}")
        if not 0.0 <= self.min_accuracy <= 1.0:
            raise ValueError(f"min_accuracy must be in [0, 1], not {self.min_accuracy}")

    def depth_values(self) -> list[float]:
        return [0.5] if self.depths == 1 else [i / (self.depths - 1) for i in range(self.depths)]

    def grid(self) -> list[tuple[int, float, int]]:
        """(length, depth, seed) of every sample, in order."""
        points = [(n, d) for n in self.lengths for d in self.depth_values()]
        return [(n, d, self.seed + i) for i, (n, d) in enumerate(points)]


def answer_attention(state: LayerState) -> torch.Tensor:
    """(B, H_q, n, T) float32 softmax of the state's last ``n`` queries over the keys each sees."""
    b, h_kv, t, d = state.keys.shape
    n, g = state.queries.shape[2], state.group_size
    q = state.queries.reshape(b, h_kv, g * n, d)
    logits = (torch.matmul(q, state.keys.transpose(-1, -2)).float() * state.scaling).view(b, h_kv, g, n, t)
    cols = torch.arange(t, device=logits.device)
    rows = torch.arange(t - n, t, device=logits.device)
    allowed = (cols[None, :] <= rows[:, None])[None, None, None] & state.valid[:, None, None, None, :]
    weights = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return weights.reshape(b, h_kv * g, n, t)


def head_scores_of(
    weights: torch.Tensor, tokens: torch.Tensor, answer: torch.Tensor, needle: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """Both variants' scores (H_q,) of one layer, from its (H_q, n, T) answer-step attention.

    ``tokens`` (T,) are the input ids, ``answer`` (n,) the tokens produced at the ``n`` steps.
    """
    start, end = needle
    top = weights.argmax(dim=-1)  # (H_q, n)
    in_needle = (top >= start) & (top < end)
    copies = tokens[top] == answer[None, :]
    retrieval = (in_needle & copies).float().mean(dim=-1)
    k = min(end - start, weights.shape[-1])
    values, index = weights.topk(k, dim=-1)  # (H_q, n, k)
    inside = (index >= start) & (index < end)
    reasoning = (values * inside).sum(dim=-1).mean(dim=-1)
    return {RETRIEVAL: retrieval, RETRIEVAL_REASONING: reasoning}


@torch.no_grad()
def score_sample(
    model: Any, input_ids: list[int], prompt_len: int, needle: tuple[int, int]
) -> tuple[dict[str, torch.Tensor], float]:
    """Per-variant (L, H_q) scores of one sample and the share of answer tokens greedy decoding produces."""
    device = input_device(model)
    answer = torch.tensor(input_ids[prompt_len:], device=device)
    n = int(answer.shape[0])
    ids = torch.tensor([input_ids[:-1]], device=device)  # the last answer token produces nothing we score
    states, logits = capture_prefill(model, ids, torch.ones_like(ids), window=n, num_queries=n, logits_to_keep=n)
    accuracy = float((logits[0].argmax(-1) == answer).float().mean())
    per_layer: dict[str, list[torch.Tensor]] = {v: [] for v in VARIANTS}
    for state in states:
        scores = head_scores_of(answer_attention(state)[0], ids[0], answer, needle)
        for variant, value in scores.items():
            per_layer[variant].append(value.double().cpu())
    return {v: torch.stack(rows) for v, rows in per_layer.items()}, accuracy


def compute_head_scores(
    model: Any,
    tokenizer: Any,
    parameters: ScoringParameters | None = None,
    *,
    model_name: str | None = None,
    progress: bool = True,
) -> HeadScores:
    """Run the procedure of the module docstring on ``model``; returns the scores with provenance.

    Raises
    ------
    ValueError
        If no sample reaches ``min_accuracy`` (the scores would be empty).
    """
    params = parameters or ScoringParameters()
    attach(model)
    config = model.config
    arch = architecture(config)
    layers, heads, kv_heads = arch["num_hidden_layers"], arch["num_attention_heads"], arch["num_key_value_heads"]
    started = time.perf_counter()
    totals, records = _score_grid(model, tokenizer, params, (layers, heads), progress)
    count = sum(r["used"] for r in records)
    if count == 0:
        best = max(r["accuracy"] for r in records)
        raise ValueError(
            f"the model produced the needle in none of the {len(records)} samples (best token accuracy {best:.2f} "
            f"< min_accuracy {params.min_accuracy}); the scores would be empty. Use shorter lengths, or a lower "
            "min_accuracy (--min-accuracy) for a model that cannot retrieve"
        )
    query_scores = {v: totals[v] / count for v in VARIANTS}
    kv_scores = {v: s.view(layers, kv_heads, heads // kv_heads).mean(-1) for v, s in query_scores.items()}
    elapsed = time.perf_counter() - started
    return HeadScores(
        model=model_name or name_of(config),
        architecture=arch,
        scores={v: _rows(s) for v, s in kv_scores.items()},
        default_variant=RETRIEVAL_REASONING,
        query_head_scores={v: _rows(s) for v, s in query_scores.items()},
        procedure=_procedure(params),
        samples={"total": len(records), "used": count, "elapsed_s": round(elapsed, 1), "runs": records},
        created=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        versions=versions(),
    )


def _score_grid(
    model: Any, tokenizer: Any, params: ScoringParameters, shape: tuple[int, int], progress: bool
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """Score every sample of ``params.grid()``: per-variant (L, H_q) sums over the counted samples,
    and one record per sample (its length, depth, seed, tokens, accuracy, whether it counted)."""
    totals = {v: torch.zeros(*shape, dtype=torch.float64) for v in VARIANTS}
    records: list[dict[str, Any]] = []
    for length, depth, seed in tqdm(params.grid(), desc="head scores", unit="sample", disable=not progress):
        sample = make_retrieval_sample(tokenizer, length, depth, seed, chat=params.chat)
        scores, accuracy = score_sample(model, sample.input_ids, sample.prompt_len, sample.needle)
        used = accuracy >= params.min_accuracy
        if used:
            for variant in VARIANTS:
                totals[variant] += scores[variant]
        records.append(
            {"length": length, "depth": round(depth, 4), "seed": seed, "tokens": len(sample.input_ids) - 1}
            | {"accuracy": round(accuracy, 4), "used": used}
        )
        logger.info("sample of %d tokens, depth %.2f: accuracy %.2f, used: %s", length, depth, accuracy, used)
    return totals, records


def _procedure(params: ScoringParameters) -> dict[str, Any]:
    """The scoring procedure as recorded in the scores file."""
    return {
        # the procedure's recorded name, as every scores file holds it (the module was headscores/compute.py)
        "name": "needle-retrieval head scoring (criticalkv.headscores.compute)",
        "references": REFERENCES,
        "parameters": asdict(params) | {"depth_values": [round(d, 4) for d in params.depth_values()]},
        "needle": "One of the special magic numbers for {key} is: {7-digit number}.",
        "haystack": "RULER noise sentences",
        "answer_prefix": "The special magic number for {key} is ",
        "aggregation": "mean over counted samples and answer tokens; KV head = mean over its query heads",
    }


def _rows(matrix: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(round(float(v), 8) for v in row) for row in matrix.tolist())
