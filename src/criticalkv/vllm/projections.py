"""Each attention block's output projection ``W_O``, read from the checkpoint for the Critical scores.

On the CPU, vLLM 0.32 hands every linear layer's weight to a packed GEMM after loading and leaves an
empty ``weight`` behind (``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``), so the plugin
reads ``o_proj``'s weight from the model's safetensors files itself, once, for the methods that read
``||V W_O||`` (``needs.value_norms``). No vLLM import.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn


class ProjectionView(nn.Module):
    """What a :class:`~criticalkv.state.LayerState`'s ``module`` gives the scores: ``o_proj.weight``
    (hidden, H_q * head_dim) and ``scaling`` (the attention's softmax scale)."""

    def __init__(self, weight: torch.Tensor | None, scaling: float) -> None:
        super().__init__()
        self.o_proj = nn.Module()
        self.o_proj.register_buffer("weight", weight, persistent=False)
        self.scaling = scaling


def _weight_files(folder: Path) -> dict[str, Path]:
    """Each tensor name of the checkpoint in ``folder`` and the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in mapping.items()}
    files = sorted(folder.glob("*.safetensors"))
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            found.update(dict.fromkeys(handle.keys(), file))
    return found


def output_projections(folder: str | Path, prefixes: list[str], dtype: torch.dtype) -> list[torch.Tensor]:
    """The ``{prefix}.o_proj.weight`` tensor of every attention block ``prefix`` (vLLM's module
    names, e.g. ``model.layers.0.self_attn``), in ``dtype``, from the checkpoint in ``folder``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(
            f"criticalkv reads the output projections of {folder} from its safetensors files: pass a local "
            "model folder (or a method that does not read them, e.g. snapkv)"
        )
    files = _weight_files(folder)
    weights = []
    for prefix in prefixes:
        name = f"{prefix}.o_proj.weight"
        if name not in files:
            raise ValueError(f"{folder} has no tensor {name}: criticalkv reads each attention block's o_proj weight")
        with safe_open(str(files[name]), framework="pt") as handle:
            weights.append(handle.get_tensor(name).to(dtype))
    return weights
