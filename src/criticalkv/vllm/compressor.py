"""The worker's side: capture the observation window's queries, compress a request once its prompt
is computed, and address its cache by the entries it holds while RoPE keeps the true positions.

One :class:`Compressor` lives in each vLLM model runner (see :mod:`criticalkv.vllm.runner`). Each
step it

1. *plans* (after vLLM prepared the step's inputs): for requests already compressed, it lowers the
   sequence lengths by the evicted count and recomputes their cache slots from ``position - evicted``
   (positions stay as they are, so RoPE sees the true ones); for requests whose prompt window is in
   this step, it notes which rows of the batch to capture;
2. *captures*, in a forward pre-hook of every attention layer, the keys and values (after RoPE) of
   those requests' prompt tokens and the queries of their observation windows;
3. *compresses*, after the forward pass, each request whose prompt this step completed: per layer it
   selects with the method (scores, budgets, selection: the transformers path's parts) and writes
   the kept entries, each KV head its own, into the first blocks of the request with vLLM's cache
   update op (:mod:`criticalkv.vllm.paged`); the scheduler then frees the blocks after them
   (:mod:`criticalkv.vllm.blocks`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from criticalkv.state import LayerState
from criticalkv.vllm.paged import compacted_slots, compaction_order, gather_heads, head_blocks
from criticalkv.vllm.plugin_options import PluginOptions, freed_blocks, kept_entries

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionLayer:
    """One decoder layer as the plugin sees it: vLLM's attention layer (its cache and head counts)
    and the attention block around it (``o_proj`` and ``scaling``, what the scores read)."""

    index: int
    attention: Any  # vllm.model_executor.layers.attention.Attention (its kv_cache, impl and head counts)
    block: nn.Module


@dataclass
class _Capture:
    """The rows of this step's batch to keep: every token of the requests being prefilled (keys and
    values) and their windows' tokens (queries)."""

    kv_rows: torch.Tensor  # (n,) indices into the step's tokens
    kv_targets: list[tuple[str, int, int]]  # (request, first row in kv_rows, count), in position order
    q_rows: torch.Tensor
    q_targets: list[tuple[str, int, int, int]]  # (request, first row in q_rows, window slot, count)


@dataclass
class _Prompt:
    """What a request being prefilled has given so far, per layer: chunks of its keys and values
    (tokens, H_kv, d) and its window's queries (window, H_q, d)."""

    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    queries: list[torch.Tensor | None]

    @classmethod
    def empty(cls, layers: int) -> _Prompt:
        return cls([[] for _ in range(layers)], [[] for _ in range(layers)], [None] * layers)


@dataclass
class Stats:
    """What the plugin did so far in this worker."""

    compressed: int = 0
    left_whole: int = 0
    entries_before: int = 0
    entries_after: int = 0
    seconds: float = 0.0
    #: per request, the kept prompt positions of every (layer, KV head), when recording (tests)
    kept: dict[str, list[list[list[int]]]] = field(default_factory=dict)


class Compressor:
    """The plugin's state in one model runner (see the module)."""

    def __init__(self, options: PluginOptions, layers: list[AttentionLayer], block_size: int) -> None:
        self.options = options
        self.spec = options.spec()
        self.layers = layers
        self.block_size = block_size
        #: per compressed request, the entries evicted from each (layer, head): position - cache index
        self.evicted: dict[str, int] = {}
        #: per request being prefilled (and to be compressed), what its prompt gave so far
        self.prompts: dict[str, _Prompt] = {}
        self.capture: _Capture | None = None
        self.finishing: list[tuple[str, int, int]] = []  # (request, batch row, entries computed after the step)
        self.stats = Stats()
        self.record = False
        self._captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    # --- the requests' lifetime ------------------------------------------------------------------
    def forget(self, request_ids: set[str] | list[str] | None) -> None:
        """Drop what is held for requests that finished, or that vLLM will prefill again (preempted)."""
        for request in request_ids or ():
            self.evicted.pop(request, None)
            self.prompts.pop(request, None)

    # --- 1. plan ---------------------------------------------------------------------------------
    def plan(self, runner: Any, scheduled: np.ndarray) -> None:
        """After vLLM prepared a step's inputs: address the compressed requests by cache index and
        note the rows to capture and the requests whose prompt this step completes."""
        batch = runner.input_batch
        count = batch.num_reqs
        requests = list(batch.req_ids[:count])
        computed = batch.num_computed_tokens_cpu[:count].astype(np.int64)
        prompts = batch.num_prompt_tokens[:count].astype(np.int64)
        starts = runner.query_start_loc.np[: count + 1].astype(np.int64)
        shift = np.array([self.evicted.get(r, 0) for r in requests], dtype=np.int64)
        if shift.any():
            self._shift_to_cache_indices(runner, shift, scheduled[:count], starts)
        self.capture, self.finishing = None, []
        kv_rows: list[np.ndarray] = []
        q_rows: list[np.ndarray] = []
        kv_targets: list[tuple[str, int, int]] = []
        q_targets: list[tuple[str, int, int, int]] = []
        for row, request in enumerate(requests):
            begin, end, prompt = int(computed[row]), int(computed[row] + scheduled[row]), int(prompts[row])
            if request in self.evicted or begin >= prompt:
                continue
            if kept_entries(self.spec, prompt) == prompt:
                self.stats.left_whole += int(end >= prompt)
                continue
            kv_targets.append((request, sum(map(len, kv_rows)), end - begin))
            kv_rows.append(np.arange(starts[row], starts[row] + end - begin))
            low, high = max(begin, prompt - self.spec.window), min(end, prompt)
            if low < high:
                first = int(starts[row]) + low - begin
                q_targets.append((request, sum(map(len, q_rows)), low - (prompt - self.spec.window), high - low))
                q_rows.append(np.arange(first, first + high - low))
            if end >= prompt:
                self.finishing.append((request, row, end))
        if kv_rows:
            q_index = torch.from_numpy(np.concatenate(q_rows)) if q_rows else torch.zeros(0, dtype=torch.long)
            self.capture = _Capture(torch.from_numpy(np.concatenate(kv_rows)), kv_targets, q_index, q_targets)

    @staticmethod
    def _shift_to_cache_indices(runner: Any, shift: np.ndarray, scheduled: np.ndarray, starts: np.ndarray) -> None:
        """Sequence lengths and cache slots of the step by cache index (``position - evicted``)."""
        count = shift.shape[0]
        by_row = torch.from_numpy(shift)
        runner.seq_lens[:count] -= by_row.to(runner.seq_lens.device, runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:count] -= by_row.to(runner.optimistic_seq_lens_cpu.dtype)
        tokens = int(starts[count])
        positions = runner.positions[:tokens]
        by_token = torch.from_numpy(np.repeat(shift, scheduled)).to(positions.device, positions.dtype)
        loc = runner.query_start_loc.gpu[: count + 1]
        runner.input_batch.block_table.compute_slot_mapping(count, loc, positions - by_token)

    # --- 2. capture ------------------------------------------------------------------------------
    def hook(self, layer: AttentionLayer) -> Any:
        """A forward pre-hook for ``layer``'s attention: keeps the planned rows of its inputs."""

        def keep_inputs(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            capture = self.capture
            if capture is None:
                return
            query, key, value = (*args, *(kwargs[k] for k in ("query", "key", "value")[len(args) :]))[:3]
            heads, kv_heads, dim = int(module.num_heads), int(module.num_kv_heads), int(module.head_size)
            kv_rows, q_rows = capture.kv_rows.to(query.device), capture.q_rows.to(query.device)
            self._captured[layer.index] = (
                query.index_select(0, q_rows).view(-1, heads, dim).clone(),
                key.index_select(0, kv_rows).view(-1, kv_heads, dim).clone(),
                value.index_select(0, kv_rows).view(-1, kv_heads, dim).clone(),
            )

        return keep_inputs

    def collect(self) -> None:
        """After the forward pass: file the captured rows under their requests."""
        capture = self.capture
        if capture is None:
            return
        for layer in self.layers:
            queries, keys, values = self._captured[layer.index]
            for request, first, count in capture.kv_targets:
                held = self.prompts.setdefault(request, _Prompt.empty(len(self.layers)))
                held.keys[layer.index].append(keys[first : first + count])
                held.values[layer.index].append(values[first : first + count])
            for request, first, slot, count in capture.q_targets:
                held = self.prompts[request]
                if held.queries[layer.index] is None:
                    held.queries[layer.index] = queries.new_zeros(self.spec.window, *queries.shape[1:])
                held.queries[layer.index][slot : slot + count] = queries[first : first + count]  # type: ignore[index]
        self._captured.clear()
        self.capture = None

    # --- 3. compress -----------------------------------------------------------------------------
    @torch.inference_mode()
    def compress_finished(self, runner: Any) -> None:
        """Compress every request whose prompt this step completed (see the module)."""
        self.collect()
        for request, row, computed in self.finishing:
            started = time.perf_counter()
            self._compress(runner, request, row, computed)
            self.stats.seconds += time.perf_counter() - started
        self.finishing = []

    def _compress(self, runner: Any, request: str, row: int, computed: int) -> None:
        prompt = int(runner.input_batch.num_prompt_tokens[row])
        kept = kept_entries(self.spec, prompt)
        held = self.prompts.pop(request, None)
        if held is None or any(q is None for q in held.queries):
            raise RuntimeError(f"request {request}: the observation window's queries were not all captured")
        table_view = runner.input_batch.block_table[0]
        table = torch.from_numpy(table_view.block_table.np[row, : table_view.num_blocks_per_row[row]].copy())
        first, last = freed_blocks(kept, prompt, self.block_size)
        compacted = torch.cat([table[:first], table[last:]])
        budget = torch.tensor([kept])
        recorded: list[list[list[int]]] = []
        for layer in self.layers:
            keys = torch.cat(held.keys[layer.index]).transpose(0, 1)  # (H_kv, computed, d)
            values = torch.cat(held.values[layer.index]).transpose(0, 1)
            if keys.shape[1] != computed:
                raise RuntimeError(f"request {request}: captured {keys.shape[1]} of {computed} entries")
            keep = self._select(layer, held.queries[layer.index], (keys, values), prompt, budget)  # type: ignore[arg-type]
            order = compaction_order(keep, computed)
            self._store(layer, compacted, gather_heads(keys, order), gather_heads(values, order))
            if self.record:
                recorded.append(order[:, :kept].tolist())
        self._shrink_tables(runner, request, row, first, last)
        self.evicted[request] = prompt - kept
        self._count(request, prompt, kept, recorded)

    def _store(self, layer: AttentionLayer, compacted: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write each head's ``keys`` and ``values`` (H_kv, n, d) as its entries ``0 .. n - 1`` under the
        block table ``compacted``, with vLLM's own cache update (whatever layout it packs)."""
        attention: Any = layer.attention
        heads, count, dim = keys.shape
        slots = compacted_slots(compacted, heads, count, self.block_size).reshape(-1).to(keys.device)
        cache = head_blocks(attention.kv_cache)
        attention.impl.do_kv_cache_update(attention, keys.reshape(-1, 1, dim), values.reshape(-1, 1, dim), cache, slots)

    def _select(
        self,
        layer: AttentionLayer,
        queries: torch.Tensor,
        entries: tuple[torch.Tensor, torch.Tensor],
        prompt: int,
        budget: torch.Tensor,
    ) -> torch.Tensor:
        """(H_kv, T) the method's keep mask of one layer's prompt (the transformers path's parts)."""
        keys, values = entries[0][:, :prompt], entries[1][:, :prompt]
        state = LayerState(
            queries=queries.permute(1, 0, 2)[None],
            keys=keys[None],
            values=values[None],
            valid=torch.ones(1, prompt, dtype=torch.bool, device=keys.device),
            module=layer.block,
            window=self.spec.window,
            layer_idx=layer.index,
            num_layers=len(self.layers),
        )
        return self.spec.method.keep_mask(state, budget)[0]

    @staticmethod
    def _shrink_tables(runner: Any, request: str, row: int, first: int, last: int) -> None:
        """Drop the freed blocks from the worker's block tables (the batch's row and the request's own list)."""
        table_view = runner.input_batch.block_table[0]
        ids = list(table_view.block_table.np[row, : table_view.num_blocks_per_row[row]])
        table_view.add_row([int(b) for b in ids[:first] + ids[last:]], row)
        del runner.requests[request].block_ids[0][first:last]

    def _count(self, request: str, prompt: int, kept: int, recorded: list[list[list[int]]]) -> None:
        self.stats.compressed += 1
        self.stats.entries_before += prompt
        self.stats.entries_after += kept
        if self.record:
            self.stats.kept[request] = recorded
        logger.debug("request %s: %d of %d prompt entries kept per (layer, KV head)", request, kept, prompt)
