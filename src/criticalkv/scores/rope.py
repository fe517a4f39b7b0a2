"""The rotary position embedding (RoPE) of an attention layer, read from its model config.

Scores that reason about queries at other positions (Expected Attention) undo and redo the
rotation the model applied: ``rope(x, p) = s * (x cos(p f) + rotate_half(x) sin(p f))`` with the
frequencies ``f`` and the scale ``s`` of the config's RoPE type (Su et al. 2021, RoFormer,
arXiv 2104.09864; transformers' ``rotate_half`` convention).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_frequencies(module: nn.Module, head_dim: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """(head_dim / 2,) inverse frequencies and the cos/sin scale of ``module``'s RoPE."""
    config = getattr(module, "config", None)  # the model config a transformers attention module holds
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(
            f"{type(module).__name__} has no RoPE config (config.rope_parameters with rope_theta); scores that "
            "need the rotary embedding work on RoPE models loaded with transformers 5 (Llama, Mistral, Qwen2)"
        )
    if float(getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("RoPE applied to part of each head (partial_rotary_factor < 1) is not supported")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        return 1.0 / (float(params["rope_theta"]) ** exponents), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown RoPE type {rope_type!r} in the model config")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, device)
    return inv_freq.float().to(device), float(scale)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of ``positions * inv_freq``, shaped ``positions.shape + (head_dim,)``."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def unrotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """The inverse of RoPE: ``x`` (..., T, d) rotated at ``positions`` (..., T) back to position 0."""
    cos, sin = cos_sin(positions, inv_freq)
    return (x * cos - rotate_half(x) * sin) / scale


def mean_rotation(start: torch.Tensor, count: int, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, d, d) the RoPE matrix ``s * R(p)`` averaged over positions ``start .. start + count - 1``
    (``start``: (B,)), so that ``x @ R.T`` is the average rotation of ``x``."""
    d = 2 * inv_freq.shape[0]
    steps = torch.arange(count, device=start.device)
    cos, sin = cos_sin(start[:, None] + steps[None, :], inv_freq)  # (B, count, d)
    cos, sin = cos.mean(dim=1), sin.mean(dim=1)  # the rotation is linear in (cos, sin)
    eye = torch.eye(d, device=start.device)
    half = d // 2
    swap = torch.zeros(d, d, device=start.device)  # swap @ x == rotate_half(x)
    swap[:half, half:] = -torch.eye(half, device=start.device)
    swap[half:, :half] = torch.eye(half, device=start.device)
    return scale * (cos[:, :, None] * eye + sin[:, :, None] * swap)
