"""One benchmark measurement."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from criticalkv.bench.instruments import peak_device_bytes, peak_rss_bytes
from criticalkv.cache.quantized import KVQuantization, storage_options
from criticalkv.defaults import STORAGE_OPTIONS


def storage_fields(storage: KVQuantization | None) -> dict[str, Any]:
    """The storage options as bench records spell them: bits, group size and residual of quantized
    storage (:func:`~criticalkv.cache.quantized.storage_options`), each ``None`` unquantized."""
    return {**dict.fromkeys(STORAGE_OPTIONS), **storage_options(storage)}


@dataclass
class BenchRecord:
    """The measurements of one (implementation, method, context length, budget, batch size).

    ``impl`` is ``"criticalkv"`` or ``"kvpress"``; ``method`` uses criticalkv's names (``full``
    is transformers' own dynamic cache with sdpa attention, the reference). Times are seconds
    except ``decode_ms_per_token`` (milliseconds per decoding step, all batch rows together).
    ``prefill_s`` is the prompt's forward pass without the compression (``ttft_s - compress_s``);
    ``kv_bytes`` is what the cache holds right after compression, ``kv_bytes_full`` what the
    full cache holds for the same prompt; ``peak_rss_bytes`` the process's peak resident memory
    during this measurement (prefill, compression and decode). ``kv_bytes_peak`` is the most the
    cache held at any step of the decode (kvpress's: read after every step). ``decode_budget`` and
    ``decode_interval`` are set when the cache was held at a decode budget while decoding
    (:mod:`criticalkv.cache.decode.budget`); ``decode_reselections`` counts its re-selections.
    ``kv_bytes_final`` is what the cache holds after the last decode step. ``storage`` is the
    quantization of quantized storage (ours, or kvpress's press on transformers' ``QuantizedCache``;
    ``None``: the model's dtype), written as the storage options (:func:`storage_fields`) by
    :meth:`to_dict`; ``bits_per_element`` the bits per key or value element
    right after compression (scales, zero points and the full-precision residual included; for
    kvpress, over every entry its cache holds, masked ones included; ``None`` for the full
    cache). ``press`` names kvpress's press (``None`` for criticalkv's rows). ``greedy_tokens``:
    each row's greedy tokens, the one after the prompt then every decode step's (warm-up included),
    to compare with the full cache's (:func:`criticalkv.bench.tables.derived`). ``decode_ms_rounds``:
    each repeat's decode ms/token, in round order (the runs of one length and batch are interleaved,
    so round ``i`` of two records was measured at about the same time: their ratios pair by round);
    ``compress_s_rounds`` and ``prefill_s_rounds`` the same for the compression and the prefill.
    """

    impl: str
    method: str
    context_tokens: int
    budget: float
    batch_size: int
    prefill_s: float
    compress_s: float
    ttft_s: float
    decode_ms_per_token: float
    decode_tokens: int
    tokens_per_s: float
    kv_bytes: int
    kv_bytes_full: int
    peak_rss_bytes: int | None
    peak_device_bytes: int | None
    device: str
    kv_bytes_peak: int | None = None
    decode_budget: int | None = None
    decode_interval: int | None = None
    decode_reselections: int | None = None
    kv_bytes_final: int | None = None
    storage: KVQuantization | None = None
    bits_per_element: float | None = None
    press: str | None = None
    greedy_tokens: list[list[int]] | None = None
    decode_ms_rounds: list[float] | None = None
    compress_s_rounds: list[float] | None = None
    prefill_s_rounds: list[float] | None = None

    @property
    def kv_ratio(self) -> float:
        return self.kv_bytes / self.kv_bytes_full if self.kv_bytes_full else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """The record as ``records.jsonl`` holds it: every field (the storage as its options, in its
        place), then ``kv_ratio``."""
        data: dict[str, Any] = {}
        for name, value in asdict(self).items():
            if name == "storage":
                data.update(storage_fields(self.storage))
            else:
                data[name] = value
        data["kv_ratio"] = self.kv_ratio
        return data


def measured(
    impl: str,
    method: str,
    ids: torch.Tensor,
    budget: float,
    *,
    ttft_s: float,
    compress_s: float,
    step_s: float,
    decode_tokens: int,
    kv_bytes: int,
    kv_bytes_full: int,
    kv_bytes_peak: int | None = None,
    decode: tuple[int, int, int] | None = None,
    kv_bytes_final: int | None = None,
    storage: KVQuantization | None = None,
    bits_per_element: float | None = None,
    press: str | None = None,
    greedy_tokens: list[list[int]] | None = None,
) -> BenchRecord:
    """A record for a run on the (B, T) prompt ``ids`` that just ended (peak memory read now).

    ``decode``: (decode budget, interval, re-selections done) of a cache held at a decode budget;
    ``storage``: the quantization of quantized storage.
    """
    batch, length = ids.shape
    return BenchRecord(
        impl=impl,
        method=method,
        context_tokens=int(length),
        budget=float(budget),
        batch_size=int(batch),
        prefill_s=ttft_s - compress_s,
        compress_s=compress_s,
        ttft_s=ttft_s,
        decode_ms_per_token=step_s * 1e3,
        decode_tokens=decode_tokens,
        tokens_per_s=batch / step_s,
        kv_bytes=kv_bytes,
        kv_bytes_full=kv_bytes_full,
        peak_rss_bytes=peak_rss_bytes(),
        peak_device_bytes=peak_device_bytes(ids.device),
        device=str(ids.device),
        kv_bytes_peak=kv_bytes_peak,
        decode_budget=None if decode is None else decode[0],
        decode_interval=None if decode is None else decode[1],
        decode_reselections=None if decode is None else decode[2],
        kv_bytes_final=kv_bytes_final,
        storage=storage,
        bits_per_element=bits_per_element,
        press=press,
        greedy_tokens=greedy_tokens,
    )
