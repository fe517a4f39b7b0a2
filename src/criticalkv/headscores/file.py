"""Head importance score files: what they hold, how they are checked, read and written.

A file holds, for one model, a score per (layer, KV head) for each scoring variant
(``retrieval-reasoning`` and ``retrieval``, see :mod:`criticalkv.analysis.retrieval_heads`), the
per-query-head scores they were averaged from, and provenance: the model name, its
architecture fingerprint (``model_type``, layers, query heads, KV heads, ``head_dim``, hidden
size), the procedure and its parameters, the samples used, the date and library versions.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FORMAT = "criticalkv-head-scores"
VERSION = 1

#: the config fields that must agree between a score file and a model
ARCHITECTURE_KEYS: tuple[str, ...] = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
)


def architecture(config: Any) -> dict[str, Any]:
    """The architecture a score file is tied to, read off a transformers config.

    ``head_dim`` falls back to ``hidden_size // num_attention_heads`` where the config lacks
    it; ``num_key_value_heads`` to ``num_attention_heads``.
    """
    missing = [
        k for k in ("model_type", "num_hidden_layers", "num_attention_heads", "hidden_size") if not hasattr(config, k)
    ]
    if missing:
        raise TypeError(
            f"expected a transformers model config; this {type(config).__name__} lacks {', '.join(missing)}"
        )
    heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return {
        "model_type": str(config.model_type),
        "num_hidden_layers": int(config.num_hidden_layers),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_size": int(config.hidden_size),
    }


def fingerprint(arch: Mapping[str, Any]) -> str:
    """A short stable hash of an :func:`architecture` dict (16 hex digits)."""
    canonical = json.dumps({k: arch[k] for k in ARCHITECTURE_KEYS}, sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def describe(arch: Mapping[str, Any]) -> str:
    """``llama, 30 layers, 9 heads, 3 KV heads, head_dim 64, hidden 576``."""
    return (
        f"{arch['model_type']}, {arch['num_hidden_layers']} layers, {arch['num_attention_heads']} heads, "
        f"{arch['num_key_value_heads']} KV heads, head_dim {arch['head_dim']}, hidden {arch['hidden_size']}"
    )


def _matrix(value: Any, rows: int, cols: int, what: str, source: str) -> tuple[tuple[float, ...], ...]:
    """Check a nested list of ``rows`` x ``cols`` finite non-negative numbers."""
    if not isinstance(value, list) or len(value) != rows:
        count = len(value) if isinstance(value, list) else "no"
        raise ValueError(f"{source}: {what} has {count} layers, expected {rows}")
    out = []
    for layer, row in enumerate(value):
        if not isinstance(row, list) or len(row) != cols:
            count = len(row) if isinstance(row, list) else "no"
            raise ValueError(f"{source}: {what}, layer {layer} has {count} heads, expected {cols} (missing heads)")
        for head, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{source}: {what}, layer {layer}, head {head} is {v!r}, not a finite number")
            if v < 0:
                raise ValueError(f"{source}: {what}, layer {layer}, head {head} is negative ({v})")
        out.append(tuple(float(v) for v in row))
    return tuple(out)


@dataclass(frozen=True)
class HeadScores:
    """Head importance scores of one model (see the module docstring).

    Attributes
    ----------
    model : the model's name (a hub id, a folder name, ``SmolLM2-135M-Instruct``).
    architecture : see :func:`architecture`.
    scores : variant -> (layers, KV heads) scores.
    query_head_scores : variant -> (layers, query heads) scores the KV-head scores average.
    default_variant : the variant :meth:`matrix` returns by default.
    procedure : how the scores were computed (name, reference, parameters).
    samples : which samples were used (counts and per-sample outcomes).
    created : ISO 8601 UTC time of the run.
    versions : library versions of the run.
    """

    model: str
    architecture: Mapping[str, Any]
    scores: Mapping[str, tuple[tuple[float, ...], ...]]
    default_variant: str
    query_head_scores: Mapping[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict)
    procedure: Mapping[str, Any] = field(default_factory=dict)
    samples: Mapping[str, Any] = field(default_factory=dict)
    created: str = ""
    versions: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_matrix(
        cls,
        scores: torch.Tensor | Sequence[Sequence[float]],
        config: Any,
        *,
        model: str = "custom",
        variant: str = "custom",
        **provenance: Any,
    ) -> HeadScores:
        """Wrap your own (layers, KV heads) importances for the model with ``config``.

        ``provenance`` fills the other fields (``procedure``, ``samples``, ``created``, ...).
        """
        arch = architecture(config)
        matrix = torch.as_tensor(scores, dtype=torch.float64).tolist()
        source = f"scores for {model}"
        checked = _matrix(matrix, arch["num_hidden_layers"], arch["num_key_value_heads"], "the scores", source)
        if not any(v > 0 for row in checked for v in row):
            raise ValueError(f"{source}: every score is zero; no head can be preferred")
        return cls(model=model, architecture=arch, scores={variant: checked}, default_variant=variant, **provenance)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.architecture)

    @property
    def variants(self) -> list[str]:
        return list(self.scores)

    def matrix(self, variant: str | None = None) -> torch.Tensor:
        """(layers, KV heads) float64 scores of ``variant`` (default: :attr:`default_variant`)."""
        name = self.default_variant if variant is None else variant
        if name not in self.scores:
            raise ValueError(f"no {name!r} scores in this file; it has: {', '.join(self.scores)}")
        return torch.tensor(self.scores[name], dtype=torch.float64)

    def check_model(self, config: Any, source: str = "these head scores") -> None:
        """Raise a :class:`ValueError` unless ``config`` has the architecture the scores were computed on."""
        theirs = architecture(config)
        mismatched = [k for k in ARCHITECTURE_KEYS if self.architecture.get(k) != theirs[k]]
        if mismatched:
            raise ValueError(
                f"{source} were computed for {self.model} ({describe(self.architecture)}), but this model is "
                f"{describe(theirs)} (differs in {', '.join(mismatched)}); compute scores for this model with "
                "`criticalkv head-scores --model MODEL --out scores.json` and pass head_scores='scores.json'"
            )

    # --- JSON ------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        variants = {}
        for name, matrix in self.scores.items():
            entry: dict[str, Any] = {"kv_heads": [list(row) for row in matrix]}
            if name in self.query_head_scores:
                entry["query_heads"] = [list(row) for row in self.query_head_scores[name]]
            variants[name] = entry
        return {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "architecture": dict(self.architecture),
            "fingerprint": self.fingerprint,
            "default_variant": self.default_variant,
            "created": self.created,
            "versions": dict(self.versions),
            "procedure": dict(self.procedure),
            "samples": dict(self.samples),
            "scores": variants,
        }

    @classmethod
    def from_json(cls, data: Any, source: str = "head scores") -> HeadScores:
        """Parse and check a dict from :meth:`to_json` (``source`` names it in errors)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'{source} is not a criticalkv head-score file (no "format": "{FORMAT}")')
        if data.get("version") != VERSION:
            raise ValueError(f"{source} has format version {data.get('version')!r}; this criticalkv reads {VERSION}")
        arch = data.get("architecture")
        if not isinstance(arch, dict) or any(k not in arch for k in ARCHITECTURE_KEYS):
            raise ValueError(f"{source} lacks the model architecture ({', '.join(ARCHITECTURE_KEYS)})")
        layers, heads, kv_heads = arch["num_hidden_layers"], arch["num_attention_heads"], arch["num_key_value_heads"]
        variants = data.get("scores")
        if not isinstance(variants, dict) or not variants:
            raise ValueError(f"{source} holds no scores")
        scores, query_scores = {}, {}
        for name, entry in variants.items():
            if not isinstance(entry, dict) or "kv_heads" not in entry:
                raise ValueError(f'{source}: scores {name!r} lack "kv_heads"')
            scores[name] = _matrix(entry["kv_heads"], layers, kv_heads, f"{name} scores", source)
            if "query_heads" in entry:
                query_scores[name] = _matrix(entry["query_heads"], layers, heads, f"{name} query-head scores", source)
        default = str(data.get("default_variant"))
        if default not in scores:
            raise ValueError(f"{source}: default_variant {default!r} is not one of {', '.join(scores)}")
        if not any(v > 0 for row in scores[default] for v in row):
            raise ValueError(f"{source}: every {default} score is zero; recompute on samples the model solves")
        return cls(
            model=str(data.get("model", "")),
            architecture={k: arch[k] for k in ARCHITECTURE_KEYS},
            scores=scores,
            default_variant=default,
            query_head_scores=query_scores,
            procedure=data.get("procedure") or {},
            samples=data.get("samples") or {},
            created=str(data.get("created", "")),
            versions=data.get("versions") or {},
        )

    def save(self, path: str | Path) -> Path:
        """Write the file atomically (creating its folder); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(self.to_json(), handle, indent=1)
                handle.write("\n")
            os.chmod(partial, 0o644)
            os.replace(partial, path)
        except OSError as error:  # a full or read-only disk: named by the file asked for, not the partial
            raise OSError(error.errno, error.strerror, str(path)) from error
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return path


def load_head_scores(path: str | Path) -> HeadScores:
    """Read and check a head-score file.

    Raises
    ------
    ValueError
        If the file is missing, not JSON, not a head-score file, or its scores miss heads or
        hold NaN, infinite or negative values.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"head-score file {path} does not exist; compute one with "
            f"`criticalkv head-scores --model MODEL --out {path}`"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"could not read head scores from {path}: {err}") from err
    return HeadScores.from_json(data, source=str(path))
