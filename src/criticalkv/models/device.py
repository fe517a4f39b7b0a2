"""Where a model goes and in which dtype: the ``device``, ``dtype`` and ``device_map`` arguments."""

from __future__ import annotations

from typing import Any

import torch

from criticalkv.hardware import native_cpu_bf16 as native_cpu_bf16

DeviceMap = str | dict[str, Any]
"""A ``device_map`` for ``from_pretrained``: ``"auto"``, ``"balanced"``, ``"sequential"``, ... or a dict."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def _resolve_device(device: str | torch.device | None) -> torch.device:
    """The requested device, or CUDA if available else CPU; errors name what to pass instead."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string or torch.device, got {type(device).__name__}.")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"unknown device {device!r}; use e.g. 'cpu', 'cuda' or 'cuda:0'.") from error
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was requested but CUDA is not available; use device='cpu'.")
    return resolved


def _default_dtype(device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    """On CPU bfloat16 where it runs in hardware (:func:`native_cpu_bf16`), else float32;
    elsewhere the checkpoint's 16-bit dtype, else bfloat16 (float16 without bf16)."""
    if device.type == "cpu":
        return torch.bfloat16 if native_cpu_bf16() else torch.float32
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype.removeprefix("torch."))
    if checkpoint_dtype in (torch.bfloat16, torch.float16):
        return checkpoint_dtype
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def _parse_dtype(dtype: str) -> torch.dtype:
    """A dtype name such as ``"bf16"`` or ``"torch.float16"`` as a ``torch.dtype``."""
    key = dtype.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))} or a torch.dtype.")
    return _DTYPES[key]


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    """The parameter dtype to load with: ``dtype`` if given (floating-point only), else a default."""
    if dtype is None:
        return _default_dtype(device, checkpoint_dtype)
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str):
        resolved = _parse_dtype(dtype)
    else:
        raise TypeError(f"dtype must be a torch.dtype, a string or None, got {type(dtype).__name__}.")
    if not resolved.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type, got {resolved}.")
    return resolved


def _check_device_map(device_map: object) -> DeviceMap | None:
    """``device_map`` as ``from_pretrained`` takes it (a stripped string or a dict), or ``None``."""
    if device_map is None or isinstance(device_map, dict):
        return device_map
    if isinstance(device_map, str) and device_map.strip():
        return device_map.strip()
    raise TypeError(
        f"device_map must be a non-empty string such as 'auto' or a dict, got {device_map!r}; see the "
        "device_map argument of transformers' from_pretrained."
    )
