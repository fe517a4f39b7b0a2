"""Which models CriticalKV runs on: the architecture checks.

The CriticalKV cache replaces the attention of standard full-attention decoders (Llama,
Mistral, Qwen2, Qwen3), so other architectures and sliding-window attention are rejected with a
clear error.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values :func:`~criticalkv.models.load_model` accepts."""

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _sliding_window_active(config: PretrainedConfig) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", None) is False:
        return False
    layer_types = getattr(config, "layer_types", None)
    # Qwen2/Qwen3 apply the window per layer, as `layer_types` says; a window no layer uses is inert.
    return not (isinstance(layer_types, (list, tuple)) and "sliding_attention" not in layer_types)


def _check_config(config: PretrainedConfig) -> None:
    """The architecture checks that need only the config (run before loading any weights)."""
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model type {model_type!r} is not supported; CriticalKV supports these architectures "
            f"(config.model_type): {supported}. Use a model of one of them."
        )
    if _sliding_window_active(config):
        raise ValueError(
            f"this {model_type} model uses sliding-window attention "
            f"(sliding_window={config.sliding_window}), which the CriticalKV cache does not support; "
            f"use a model without sliding-window attention (supported architectures: {supported})."
        )


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The decoder's ``layers`` list, wherever the model keeps it; ``None`` if there is none."""
    candidates: list[Any] = []
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(AttributeError, NotImplementedError, TypeError):
            candidates.append(get_decoder())
    candidates += [getattr(model, "model", None), model]
    for base in candidates:
        layers = getattr(base, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    return None


def _missing_projections(layer: torch.nn.Module) -> list[str]:
    """The standard attention projections a decoder layer's ``self_attn`` lacks."""
    attn = getattr(layer, "self_attn", None)
    return [name for name in _PROJECTIONS if not isinstance(getattr(attn, name, None), torch.nn.Module)]


def check_supported(model: torch.nn.Module) -> None:
    """Check that CriticalKV can run on ``model``.

    Parameters
    ----------
    model : torch.nn.Module
        A loaded causal language model (a transformers ``PreTrainedModel``).

    Raises
    ------
    ValueError
        If ``model.config.model_type`` is not one of :data:`SUPPORTED_ARCHITECTURES`; if the
        model uses sliding-window attention (``config.sliding_window`` set and
        ``config.use_sliding_window`` not ``False``); or if a decoder layer's ``self_attn`` lacks
        the standard ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` projections.
    TypeError
        If ``model`` has no ``config`` (it is not a transformers model).
    """
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"expected a transformers PreTrainedModel, got {type(model).__name__}; "
            "load one with criticalkv.models.load_model."
        )
    _check_config(config)
    layers = _decoder_layers(model)
    if layers is None or len(layers) == 0:
        raise ValueError(
            f"could not find the decoder layers of this {config.model_type} model "
            f"({type(model).__name__}); CriticalKV needs a standard decoder with `model.layers`."
        )
    for index, layer in enumerate(layers):
        missing = _missing_projections(layer)
        if missing:
            raise ValueError(
                f"decoder layer {index} of this {config.model_type} model has non-standard attention "
                f"(self_attn lacks {', '.join(missing)}); CriticalKV needs the standard attention of "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} models."
            )
