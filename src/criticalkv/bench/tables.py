"""Tables of benchmark records: ratios against the full cache, the Critical selection's extra time, caveats."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from criticalkv.bench.plan import kvpress_counterpart
from criticalkv.cache.quantized import quantization_from_record

MB = 1e6
#: what the table's ``crit +%`` column is (the record field ``critical_overhead``)
CRITICAL_EXTRA = (
    "crit +%: the Critical selection's extra time over its base method, as a share of the prefill: "
    "(compress s - the base's compress s) / prefill s; in brackets its lowest-highest over the interleaved rounds"
)
#: what the figure's right panel shows
COMPRESS_SHARE = "compression share: compress s / prefill s (the whole selection, any method)"
#: the uniform layout that ``decode_vs_uniform`` compares every other method with, at equal bytes
UNIFORM = "snapkv"


def _key(r: dict[str, Any], *, quantized: bool = True, **changes: Any) -> tuple[Any, ...]:
    """What identifies the row ``r`` with ``changes`` among the records (``quantized=False``: its
    unquantized counterpart's)."""
    d = {**r, **changes}
    storage = quantization_from_record(d) if quantized else None
    return (d["impl"], d["method"], d["context_tokens"], d["budget"], d["batch_size"], d.get("decode_budget"), storage)


def method_label(r: dict[str, Any]) -> str:
    """The method's name, with its decode budget (``snapkv+d512``) when it decoded under one and
    its storage bits (``snapkv+q4``) when quantized."""
    label = r["method"]
    if r.get("decode_budget") is not None:
        label += f"+d{r['decode_budget']}"
    storage = quantization_from_record(r)
    if storage is not None:
        label += f"+q{storage.bits}"
    return label


def kvpress_pair(r: dict[str, Any], index: dict[tuple[Any, ...], dict[str, Any]]) -> str:
    """What a row is paired with on kvpress's side: the press measured beside it, ``none`` where
    kvpress has no counterpart, ``not run`` where it has one that was not measured (see the notes)."""
    if r["impl"] == "kvpress":
        return str(r.get("press") or r["method"])
    if r["method"] == "full":
        return "-"
    other = index.get(_key(r, impl="kvpress"))
    if other is not None:
        return str(other.get("press") or other["method"])
    return "not run" if kvpress_counterpart(r["method"], decode=r.get("decode_budget") is not None) else "none"


def _speedup(reference: dict[str, Any] | None, r: dict[str, Any]) -> float | None:
    return (
        reference["decode_ms_per_token"] / r["decode_ms_per_token"] if reference and r["decode_ms_per_token"] else None
    )


def speedup_rounds(reference: dict[str, Any] | None, r: dict[str, Any]) -> tuple[float, float] | None:
    """The lowest and highest of the round-by-round decode speed-ups of ``r`` over ``reference``
    (``decode_ms_rounds``, paired by round: the runs were interleaved); ``None`` with fewer than two
    rounds on either side or a different number of rounds."""
    if reference is None or reference is r:
        return None
    ours, theirs = r.get("decode_ms_rounds") or [], reference.get("decode_ms_rounds") or []
    if len(ours) < 2 or len(ours) != len(theirs) or not all(ours):
        return None
    ratios = [b / a for a, b in zip(ours, theirs, strict=True)]
    return min(ratios), max(ratios)


def overhead_rounds(base: dict[str, Any] | None, r: dict[str, Any]) -> tuple[float, float] | None:
    """The lowest and highest round-by-round ``crit +%`` share (``(compress - base's compress) /
    prefill``, round ``i`` against round ``i``); ``None`` without two paired rounds."""
    if base is None:
        return None
    mine, theirs = r.get("compress_s_rounds") or [], base.get("compress_s_rounds") or []
    prefill = r.get("prefill_s_rounds") or []
    if len(mine) < 2 or not len(mine) == len(theirs) == len(prefill) or not all(p > 0 for p in prefill):
        return None
    shares = [(a - b) / p for a, b, p in zip(mine, theirs, prefill, strict=True)]
    return min(shares), max(shares)


def token_match(full: dict[str, Any] | None, r: dict[str, Any]) -> float | None:
    """The share of ``r``'s greedy tokens equal to the full cache's at the same step of the same
    row (``None`` where either has none, or for the full cache itself): 1.00 = the same text."""
    ours, reference = r.get("greedy_tokens"), None if full is None else full.get("greedy_tokens")
    if not ours or not reference or r is full or len(ours) != len(reference):
        return None
    pairs = [(a, b) for row, ref in zip(ours, reference, strict=True) for a, b in zip(row, ref, strict=False)]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def base_method(method: str) -> str | None:
    """``critical-adakv`` -> ``adakv``: the method a Critical variant adds its selection to."""
    return method.removeprefix("critical-") if method.startswith("critical-") else None


def derived(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records with ratios: decode speed-up over the full cache (same length and batch), over
    kvpress's same method (same decode budget and storage), over SnapKV at the same budget
    (``decode_vs_uniform``: a method whose heads keep different counts against the uniform layout
    holding the same bytes; 1.00x = as fast), over the same row unquantized (``decode_vs_unquantized``:
    the unquantized cache's ms/token over the quantized one's; below 1.00x = slower), the
    Critical selection's extra time over its base, as a share of the prefill, ``token_match``
    (:func:`token_match`) and ``kvpress_pair``."""
    index = {_key(r): r for r in records}
    out = []
    for r in records:
        row = dict(r)
        full = index.get(_key(r, impl="criticalkv", method="full", budget=1.0, decode_budget=None, quantized=False))
        row["decode_speedup_vs_full"] = _speedup(full, r)
        row["decode_speedup_vs_full_range"] = speedup_rounds(full, r)
        row["token_match"] = token_match(full, r)
        other = index.get(_key(r, impl="kvpress")) if r["impl"] == "criticalkv" else None
        row["decode_speedup_vs_kvpress"] = _speedup(other, r)
        uniform = index.get(_key(r, method=UNIFORM)) if r["method"] not in (UNIFORM, "full") else None
        row["decode_vs_uniform"] = _speedup(uniform, r)
        plain = index.get(_key(r, quantized=False)) if quantization_from_record(r) is not None else None
        row["decode_vs_unquantized"] = _speedup(plain, r)
        row["kvpress_pair"] = kvpress_pair(r, index)
        base = base_method(r["method"])
        base_row = index.get(_key(r, method=base)) if base else None
        row["critical_overhead"] = (
            (r["compress_s"] - base_row["compress_s"]) / r["prefill_s"] if base_row and r["prefill_s"] > 0 else None
        )
        row["critical_overhead_range"] = overhead_rounds(base_row, r)
        out.append(row)
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mb(value: int | None, spec: str) -> str:
    return _fmt(None if value is None else value / MB, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


#: what the table's ``spread`` column is, and why a ``vs full`` cell can read ``?``
SPREAD = (
    "spread: the lowest-highest decode speed-up over the full cache across the interleaved repeats (round i "
    "of each method against round i of the full cache); 'vs full' reads '?' where the spread crosses 1.00x: "
    "which is faster is not settled on this machine at this load"
)


def _vs_full(r: dict[str, Any]) -> tuple[str, str]:
    """The ``vs full`` and ``spread`` cells: the ratio of the fastest times, ``?`` where the rounds
    disagree on which is faster."""
    spread = r.get("decode_speedup_vs_full_range")
    if spread is None:
        return _ratio(r["decode_speedup_vs_full"]), "-"
    low, high = spread
    ratio = "?" if low < 1.0 < high else _ratio(r["decode_speedup_vs_full"])
    return ratio, f"{low:.2f}-{high:.2f}"


def format_table(records: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """A fixed-width table, one line per record, then ``notes`` (why a kvpress pair is missing).

    ``KV MB`` is what the cache holds right after compression, ``KV peak`` the most at any decode
    step and ``KV final`` after the last; ``bits`` the bits per element held after compression; ``vs
    16b`` the decode speed over the same row unquantized; ``match`` the share of greedy tokens equal
    to the full cache's; ``kvpress`` the press beside the row; ``spread`` (:data:`SPREAD`) the
    round-by-round range of ``vs full``, which reads ``?`` where that range crosses 1.00x."""
    header = (
        f"{'impl':<10} {'method':<22} {'ctx':>6} {'budget':>6} {'batch':>5} {'prefill s':>9} {'compress s':>10} "
        f"{'crit +%':>20} {'ttft s':>7} {'ms/tok':>7} {'tok/s':>6} {'vs full':>7} {'spread':>9} {'vs kvp':>6} "
        f"{'vs snap':>7} {'vs 16b':>6} {'KV MB':>7} {'KV ratio':>8} {'KV peak':>7} {'KV final':>8} {'bits':>5} "
        f"{'match':>5} {'peak MB':>8}  kvpress"
    )
    lines = [header, "-" * len(header)]
    for r in derived(records):
        overhead = r["critical_overhead"]
        rss, kv_peak, kv_final = r.get("peak_rss_bytes"), r.get("kv_bytes_peak"), r.get("kv_bytes_final")
        share = "-" if overhead is None else f"{100 * overhead:.2f}%"
        if r["critical_overhead_range"] is not None:
            share += " ({:.1f}-{:.1f})".format(*(100 * x for x in r["critical_overhead_range"]))
        vs_full, spread = _vs_full(r)
        lines.append(
            f"{r['impl']:<10} {method_label(r):<22} {r['context_tokens']:>6} {r['budget']:>6g} {r['batch_size']:>5} "
            f"{r['prefill_s']:>9.2f} {r['compress_s']:>10.3f} {share:>20} "
            f"{r['ttft_s']:>7.2f} {r['decode_ms_per_token']:>7.1f} {r['tokens_per_s']:>6.1f} "
            f"{vs_full:>7} {spread:>9} {_ratio(r['decode_speedup_vs_kvpress']):>6} "
            f"{_ratio(r['decode_vs_uniform']):>7} {_ratio(r['decode_vs_unquantized']):>6} "
            f"{r['kv_bytes'] / MB:>7.2f} {r['kv_ratio']:>8.3f} {_mb(kv_peak, '>7.2f')} {_mb(kv_final, '>8.2f')} "
            f"{_fmt(r.get('bits_per_element'), '>5.2f')} {_fmt(r['token_match'], '>5.2f')} {_mb(rss, '>8.0f')}  "
            f"{r['kvpress_pair']}"
        )
    lines += [f"note: {note}" for note in notes]
    lines += [f"definition: {CRITICAL_EXTRA}", f"definition: {COMPRESS_SHARE}", f"definition: {SPREAD}"]
    return "\n".join(lines)


def caveats(repeats: int, load: float | None = None, cores: int | None = None) -> list[str]:
    """Warnings a bench prints beside its figures: one repeat (a single measurement per run), or a
    1-minute load average (``os.getloadavg`` where ``None``) above the core count (``os.cpu_count``)."""
    out = []
    if repeats <= 1:
        out.append(
            "warning: --repeats 1: every time is one measurement and no spread is known, so the ratios (vs full, "
            "crit +%) can move by tens of percent between runs (even flip); the default --repeats 3 interleaves "
            "the methods and shows the spread"
        )
    return out + load_caveat(load, cores)


def load_caveat(load: float | None = None, cores: int | None = None) -> list[str]:
    """A warning where the 1-minute load average (``os.getloadavg`` where ``None``) is above the core
    count (``os.cpu_count`` where ``None``): the times beside it are inflated and noisy."""
    if load is None and hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
    cores = os.cpu_count() if cores is None else cores
    if load is not None and cores and load > cores:
        return [
            f"warning: the load average ({load:.2f} over 1 min) is above the {cores} cores: other processes "
            "share the CPU, so the times are inflated and noisy"
        ]
    return []
