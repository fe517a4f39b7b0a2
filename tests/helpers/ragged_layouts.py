"""Random ragged paged layouts for ``torch.ops.criticalkv.ragged_decode`` and a loop reference.

:func:`random_layout` builds, for given per-sequence lengths, a pool whose blocks are shuffled
(so a sequence's blocks are not contiguous), its block table, optional 8/4-bit codes with their
statistics (keys per channel over a block, values per entry over channel groups, as the codec
quantizes), a tail with its mask, and the dense per-sequence entries the codes stand for.
:func:`loop_reference` attends sequence by sequence from those dense entries: the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from criticalkv.cache.quantized.codec import pack, quantize


@dataclass
class Layout:
    """The op's keyword arguments (``inputs``) and each sequence's dense (L, D) keys and values."""

    inputs: dict[str, Any]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def random_layout(
    lengths: list[int],
    *,
    queries: int = 4,
    head_dim: int = 16,
    block_size: int = 4,
    tail: int = 0,
    bits: int = 16,
    value_group: int = 8,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 2,
    compact: bool = False,
) -> Layout:
    """A layout of ``len(lengths)`` sequences (see the module docstring); ``compact`` stores each
    partial block at its real length (``entry_starts`` then says where every block starts)."""
    g = torch.Generator().manual_seed(seed)
    s, d = len(lengths), head_dim
    blocks_of = [-(-n // block_size) for n in lengths]
    total = sum(blocks_of) + spare_blocks
    order = torch.randperm(total, generator=g).tolist()  # pool block of the k-th block handed out
    width = max([1, *blocks_of])
    table = torch.full((s, width), -1, dtype=torch.int32)
    keys = torch.randn(total * block_size, d, generator=g)
    values = torch.randn(total * block_size, d, generator=g)
    handed = 0
    for i, nb in enumerate(blocks_of):
        table[i, :nb] = torch.tensor(order[handed : handed + nb], dtype=torch.int32)
        handed += nb
    inputs: dict[str, Any] = {
        "query": torch.randn(s, queries, d, generator=g).to(dtype),
        "block_table": table,
        "lengths": torch.tensor(lengths, dtype=torch.int32),
        "block_size": block_size,
        "scaling": d**-0.5,
        "bits": bits,
    }
    if bits == 16:
        inputs["key_pool"], inputs["value_pool"] = keys.to(dtype), values.to(dtype)
        dense_k, dense_v = keys.to(dtype).float(), values.to(dtype).float()
    else:
        dense_k, dense_v = _quantized(inputs, keys, values, bits, block_size, value_group)
    if tail:
        inputs["tail_keys"] = torch.randn(s, tail, d, generator=g).to(dtype)
        inputs["tail_values"] = torch.randn(s, tail, d, generator=g).to(dtype)
        mask = torch.rand(s, queries, tail, generator=g) > 0.3
        inputs["tail_mask"] = mask
    rows = [_rows(table[i], n, block_size) for i, n in enumerate(lengths)]
    layout = Layout(inputs, [dense_k[r] for r in rows], [dense_v[r] for r in rows])
    if compact:
        _compact(inputs, table, lengths, block_size, total)
    return layout


def _compact(inputs: dict[str, Any], table: torch.Tensor, lengths: list[int], block_size: int, total: int) -> None:
    """Drop the padding rows of partial blocks from the entry-indexed pools; set ``entry_starts``."""
    real = [block_size] * total
    for i, n in enumerate(lengths):
        if n % block_size:
            real[int(table[i, n // block_size])] = n % block_size
    keep = torch.cat([torch.arange(b * block_size, b * block_size + r) for b, r in enumerate(real)])
    starts = torch.tensor([0, *real[:-1]]).cumsum(0)
    for name in ("key_pool", "value_pool", "value_scale", "value_zero"):
        if name in inputs:
            inputs[name] = inputs[name][keep]
    inputs["entry_starts"] = starts.to(torch.int32)


def _rows(blocks: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    starts = blocks[: -(-length // block_size)].long() * block_size
    return (starts[:, None] + torch.arange(block_size)).reshape(-1)[:length]


def _quantized(
    inputs: dict[str, Any], keys: torch.Tensor, values: torch.Tensor, bits: int, block_size: int, value_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and statistics into ``inputs``; returns the dense entries the codes stand for."""
    p, d = keys.shape
    kc, ks, kz = quantize(keys.view(-1, block_size, d), bits, dim=1)  # per channel over a block
    vc, vs, vz = quantize(values.view(p, d // value_group, value_group), bits, dim=-1)  # per entry and group
    inputs.update(
        key_pool=pack(kc.view(p, d), bits),
        value_pool=pack(vc.view(p, d), bits),
        key_scale=ks.view(-1, d),
        key_zero=kz.view(-1, d),
        value_scale=vs.view(p, -1),
        value_zero=vz.view(p, -1),
        value_group=value_group,
    )
    dense_k = (kc.float() * ks.float() + kz.float()).view(p, d)
    dense_v = (vc.float() * vs.float() + vz.float()).view(p, d)
    return dense_k, dense_v


def loop_reference(layout: Layout) -> torch.Tensor:
    """Attention sequence by sequence, in float64, from the dense entries (the oracle)."""
    x = layout.inputs
    out = torch.zeros(x["query"].shape, dtype=torch.float64)
    for i, (k, v) in enumerate(zip(layout.keys, layout.values, strict=True)):
        q = x["query"][i].double() * x["scaling"]
        scores, vals = q @ k.double().T, v.double()
        if "tail_keys" in x:
            tail = q @ x["tail_keys"][i].double().T
            tail = tail.masked_fill(~x["tail_mask"][i], float("-inf"))
            scores, vals = torch.cat([scores, tail], 1), torch.cat([vals, x["tail_values"][i].double()])
        for r in range(scores.shape[0]):
            if torch.isinf(scores[r]).all():
                continue  # nothing to attend: zeros
            out[i, r] = torch.softmax(scores[r], 0) @ vals
    return out


def read_rows(inputs: dict[str, Any]) -> torch.Tensor:
    """(P,) bool: the pool rows some sequence's entries are (the rest is padding or spare blocks)."""
    table, lengths, size = inputs["block_table"], inputs["lengths"], inputs["block_size"]
    starts = inputs.get("entry_starts")
    used = torch.zeros(int(inputs["key_pool"].shape[0]), dtype=torch.bool)
    for i, n in enumerate(lengths.tolist()):
        for pos in range(n):
            block = int(table[i, pos // size])
            used[(block * size if starts is None else int(starts[block])) + pos % size] = True
    return used


def poison_padding(layout: Layout) -> Layout:
    """The layout with NaN in every pool row no sequence owns (16 bits: the entries; 8/4 bits: the
    per-entry value statistics), so a kernel that reads past a sequence's length gives NaN. The
    dense entries are unchanged: compare with :func:`loop_reference` (the torch reference gathers
    row 0 for missing entries, so it may read a poisoned row)."""
    unused = ~read_rows(layout.inputs)
    names = ("key_pool", "value_pool") if layout.inputs["bits"] == 16 else ("value_scale", "value_zero")
    inputs = dict(layout.inputs)
    for name in names:
        inputs[name] = inputs[name].clone()
        inputs[name][unused] = float("nan")
    return Layout(inputs, layout.keys, layout.values)
