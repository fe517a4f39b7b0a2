"""Aggregating result rows over samples: per-head means and base-versus-Critical comparisons."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: per-(layer, head) measures of a result row, each an L x H_q list
HEAD_MEASURES = (
    "perturbation_window",
    "perturbation_decode",
    "sigma_window",
    "sigma_decode",
    "theta_window",
    "theta_decode",
)
#: per-row scalars of the hidden-state drift
DRIFT_MEASURES = ("hidden_l1", "hidden_l1_relative", "hidden_cosine")
QUERY_SETS = ("window", "decode")


def budget_order(budget: Any) -> tuple[int, float]:
    """Sort key of budgets: fractions first, then token counts, each ascending."""
    return (1 if isinstance(budget, int) and not isinstance(budget, bool) else 0, float(budget))


@dataclass
class GroupStats:
    """One (method, budget) averaged over samples.

    Attributes
    ----------
    heads : measure name -> (L, H_q) mean over samples (:data:`HEAD_MEASURES`).
    drift : measure name -> mean over samples (:data:`DRIFT_MEASURES`).
    kept : sample -> (L, H_kv) entries kept per head.
    """

    method: str
    base: str | None
    budget: Any
    samples: list[int]
    heads: dict[str, np.ndarray]
    drift: dict[str, float]
    kept: dict[int, np.ndarray]
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        layers, heads = self.heads["perturbation_window"].shape
        return int(layers), int(heads)


@dataclass
class PairStats:
    """A base method versus its Critical variant at one budget, on the samples both have.

    ``reduction[q]`` is the per-head relative reduction ``1 - L_critical / L_base`` of the
    sample-mean perturbation on query set ``q`` (``"window"`` or ``"decode"``).
    """

    base: GroupStats
    variant: GroupStats
    reduction: dict[str, np.ndarray]
    improved: dict[str, float]  # share of heads whose mean perturbation the variant lowers
    improved_per_sample: dict[str, float]  # share of (sample, head) pairs it lowers
    mean_reduction: dict[str, float]  # mean over heads of the per-head relative reduction
    median_reduction: dict[str, float]  # its median (robust to heads whose base perturbation is ~0)
    overall_reduction: dict[str, float]  # 1 - sum over heads of L_critical / that of L_base
    layer_improved: dict[str, np.ndarray]  # (L,) share of each layer's heads lowered
    budgets_match: bool  # per-head budgets identical on every sample

    @property
    def budget(self) -> Any:
        return self.base.budget


def _group(method: str, budget: Any, rows: Mapping[int, Mapping[str, Any]], samples: Sequence[int]) -> GroupStats:
    picked = [rows[s] for s in samples]
    heads = {m: np.mean([np.asarray(r[m], dtype=np.float64) for r in picked], axis=0) for m in HEAD_MEASURES}
    drift = {m: float(np.mean([float(r[m]) for r in picked])) for m in DRIFT_MEASURES}
    counts = {
        name: int(sum(int(r.get(name, 0)) for r in picked))
        for name in ("bound_violations", "bound_violations_sigma_above_half", "sigma_above_half")
    }
    layers, n_heads = heads["perturbation_window"].shape
    counts["measured"] = int(sum(int(r["queries"]) * layers * n_heads for r in picked))
    return GroupStats(
        method=method,
        base=picked[0].get("base"),
        budget=picked[0]["budget"],
        samples=list(samples),
        heads=heads,
        drift=drift,
        kept={s: np.asarray(rows[s]["kept"]) for s in samples},
        counts=counts,
    )


def _relative(base: np.ndarray, variant: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(base > 0, 1.0 - variant / np.where(base > 0, base, 1.0), np.nan)


_Key = tuple[str, str]  # (method, str(budget))
_Rows = Mapping[int, Mapping[str, Any]]  # sample -> result row


def _index_rows(
    rows: Iterable[Mapping[str, Any]],
) -> tuple[dict[_Key, dict[int, Mapping[str, Any]]], dict[str, Any], dict[_Key, _Key]]:
    """Rows by (method, budget) and sample, each budget's value by its text, and each base's partner."""
    by_key: dict[_Key, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    budgets: dict[str, Any] = {}
    partner: dict[_Key, _Key] = {}
    for row in rows:
        key = (str(row["method"]), str(row["budget"]))
        by_key[key][int(row["sample"])] = row
        budgets[key[1]] = row["budget"]
        if row.get("base"):
            base_key = (str(row["base"]), key[1])
            partner[key], partner[base_key] = base_key, key
    return by_key, budgets, partner


def _pair(base: GroupStats, variant: GroupStats, base_rows: _Rows, variant_rows: _Rows) -> PairStats:
    """``variant`` against ``base`` on the samples both have."""
    common = sorted(set(variant.samples) & set(base.samples))
    reduction, improved, per_sample, mean_red, median_red, overall, layer_improved = {}, {}, {}, {}, {}, {}, {}
    for q in QUERY_SETS:
        name = f"perturbation_{q}"
        b, v = base.heads[name], variant.heads[name]
        reduction[q] = _relative(b, v)
        improved[q] = float(np.mean(v < b))
        layer_improved[q] = np.mean(v < b, axis=1)
        finite = np.isfinite(reduction[q]).any()
        mean_red[q] = float(np.nanmean(reduction[q])) if finite else float("nan")
        median_red[q] = float(np.nanmedian(reduction[q])) if finite else float("nan")
        overall[q] = float(1.0 - v.sum() / b.sum()) if b.sum() > 0 else float("nan")
        b_rows = np.stack([np.asarray(base_rows[s][name]) for s in common])
        v_rows = np.stack([np.asarray(variant_rows[s][name]) for s in common])
        per_sample[q] = float(np.mean(v_rows < b_rows))
    match = all(np.array_equal(base.kept[s], variant.kept[s]) for s in common)
    return PairStats(
        base=base,
        variant=variant,
        reduction=reduction,
        improved=improved,
        improved_per_sample=per_sample,
        mean_reduction=mean_red,
        median_reduction=median_red,
        overall_reduction=overall,
        layer_improved=layer_improved,
        budgets_match=match,
    )


def _group_order(g: GroupStats) -> tuple[Any, ...]:
    """Sort key of groups: by family, budgets ascending, the base before its variant."""
    family = g.base or g.method
    return (family, budget_order(g.budget), g.base is not None)


def aggregate(rows: Iterable[Mapping[str, Any]]) -> tuple[list[GroupStats], list[PairStats]]:
    """Average result rows over samples, and compare each Critical variant with its base.

    A base and its variant are compared (and both averaged) on the samples both were measured
    on; a method without a partner is averaged over all its samples.

    Returns
    -------
    groups : one :class:`GroupStats` per (method, budget), bases before variants, budgets ascending.
    pairs : one :class:`PairStats` per (base, budget).
    """
    by_key, budgets, partner = _index_rows(rows)
    groups: dict[_Key, GroupStats] = {}
    for key, items in by_key.items():
        other = partner.get(key)
        samples = sorted(items)
        if other is not None and other in by_key:
            common = sorted(set(items) & set(by_key[other]))
            samples = common or samples
        groups[key] = _group(key[0], budgets[key[1]], items, samples)

    pairs = []
    for key, variant in groups.items():
        if not variant.base:
            continue
        base_key = (variant.base, key[1])
        if base_key not in groups or not set(variant.samples) & set(groups[base_key].samples):
            continue
        pairs.append(_pair(groups[base_key], variant, by_key[base_key], by_key[key]))

    pairs.sort(key=lambda p: (p.base.method, budget_order(p.budget)))
    return sorted(groups.values(), key=_group_order), pairs
