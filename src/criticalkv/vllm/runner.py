"""vLLM's model runner with the plugin's three steps (plan, capture, compress) around its own.

vLLM 0.32 builds its model runner inside ``Worker.init_device`` with no seam to choose the class, so
:func:`attach` gives the built runner a subclass of its own class (a ``__class__`` change, written
against vLLM 0.32's ``GPUModelRunner`` / ``CPUModelRunner``) that overrides four methods and calls
vLLM's version in each: ``_update_states`` (forget finished and preempted requests),
``_prepare_inputs`` (then :meth:`Compressor.plan`), ``execute_model`` (then
:meth:`Compressor.compress_finished`) and ``get_kv_cache_spec`` (the layers' specs carry the options).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index

from criticalkv.vllm.blocks import EvictingAttentionSpec, is_full_attention
from criticalkv.vllm.compressor import AttentionLayer, Compressor
from criticalkv.vllm.plugin_options import PluginOptions
from criticalkv.vllm.projections import ProjectionView, output_projections


class CompressingRunner:
    """The overrides (a mixin placed before vLLM's runner class by :func:`attach`)."""

    #: ``None`` until :func:`start` (vLLM's profiling and warm-up runs pass through untouched)
    criticalkv: Compressor | None

    def _update_states(self, scheduler_output: Any) -> Any:
        result = super()._update_states(scheduler_output)  # type: ignore[misc]
        if self.criticalkv is not None:
            self.criticalkv.forget(scheduler_output.finished_req_ids)
            self.criticalkv.forget(scheduler_output.preempted_req_ids)
            self.criticalkv.forget(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
        return result

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        if self.criticalkv is not None:
            self.criticalkv.plan(self, num_scheduled_tokens)
        return result

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        result = super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        if self.criticalkv is not None:
            self.criticalkv.compress_finished(self)
        return result

    def get_kv_cache_spec(self) -> dict[str, Any]:
        specs = super().get_kv_cache_spec()  # type: ignore[misc]
        options = self.criticalkv_options  # type: ignore[attr-defined]
        for name, spec in specs.items():
            if not is_full_attention(spec):
                raise ValueError(
                    f"criticalkv's vLLM plugin compresses full-attention layers only; layer {name} is "
                    f"{type(spec).__name__}"
                )
        return {name: EvictingAttentionSpec.wrap(spec, options) for name, spec in specs.items()}


_CLASSES: dict[type, type] = {}


def _compressing(base: type) -> type:
    """The runner class ``base`` with the plugin's overrides (one per base)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Compressing{base.__name__}", (CompressingRunner, base), {})
    return _CLASSES[base]


def attach(runner: Any, options: PluginOptions) -> None:
    """Give vLLM's built ``runner`` the plugin's steps (see the module). Before the KV cache exists."""
    runner.__class__ = _compressing(type(runner))
    runner.criticalkv_options = options
    runner.criticalkv = None


def start(runner: Any) -> None:
    """Once the model is loaded: find the layers, read their output projections if the method needs
    them, and hook their attention."""
    options: PluginOptions = runner.criticalkv_options
    found = attention_modules(runner.compilation_config.static_forward_context)
    weights: list[torch.Tensor | None] = [None] * len(found)
    if options.spec().method.needs.value_norms:
        prefixes = [name.rsplit(".", 1)[0] for name, _ in found]
        weights = list(output_projections(runner.model_config.model, prefixes, runner.model_config.dtype))
    layers = [
        AttentionLayer(index, module, ProjectionView(weight, float(module.impl.scale)))
        for index, ((_, module), weight) in enumerate(zip(found, weights, strict=True))
    ]
    runner.criticalkv = Compressor(options, layers, int(runner.cache_config.block_size))
    for layer in layers:
        layer.attention.register_forward_pre_hook(runner.criticalkv.hook(layer), with_kwargs=True)


def attention_modules(context: dict[str, Any]) -> list[tuple[str, Any]]:
    """Every decoder layer's vLLM attention, by name, in layer order (one per layer)."""
    found = sorted(
        (
            (extract_layer_index(name), name, module)
            for name, module in context.items()
            if isinstance(module, Attention)
        ),
        key=lambda item: item[0],
    )
    if [index for index, _, _ in found] != list(range(len(found))):
        raise ValueError(f"expected one attention layer per decoder layer, found {[i for i, _, _ in found]}")
    return [(name, module) for _, name, module in found]
