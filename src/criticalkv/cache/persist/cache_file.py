"""Saving a compressed cache to a file and loading it back, for the model it was computed with.

The file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file. Per layer it holds
the kept keys and values (the tiers of the ragged prefix, concatenated: exactly the prefix's
bytes), the segment order and lengths, the kept positions (the keep mask, 1 bit per prompt
position) and the decode tail's used entries; a quantized layer's codes, scales and zero points
instead of its keys and values (:mod:`~criticalkv.cache.quantized.persist`). Its JSON header
(the ``criticalkv`` metadata key) holds what makes the cache valid: the model and tokenizer
fingerprints (:mod:`~criticalkv.cache.persist.fingerprint`), the method, budget, window, storage
precision (``kv_bits``, group size, residual), the prompt lengths, the library version, caller
fields such as the mode, and a SHA-256 checksum of every tensor and the rest of the header.
The write is atomic (a temporary file in the same folder, fsync, rename).
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata as package_metadata
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file

from criticalkv.cache.layer import CompressedLayer
from criticalkv.cache.persist.atomic_write import save_atomically
from criticalkv.cache.persist.fingerprint import model_fingerprint, tokenizer_fingerprint
from criticalkv.cache.quantized import KVQuantization, storage_options
from criticalkv.cache.spec import CacheSpec
from criticalkv.cache.storage import Geometry
from criticalkv.methods import Method, bind, get_method

FORMAT = "criticalkv-cache"
FORMAT_VERSION = 1
HEADER_KEY = "criticalkv"


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: truncated, corrupted, or not a criticalkv cache."""


class IncompatibleCacheError(ValueError):
    """A cache file saved for another model or tokenizer (the message says which differs)."""


class _Cache(Protocol):
    num_layers: int
    method: Method
    budget: Any
    window: int
    real_prompt_tokens: torch.Tensor | None
    budget_tokens: torch.Tensor | None
    quantization: KVQuantization | None

    @classmethod
    def from_spec(cls, num_layers: int, spec: CacheSpec) -> Any: ...

    @property
    def compressed_layers(self) -> list[CompressedLayer]: ...


C = TypeVar("C", bound=_Cache)


def library_version() -> str:
    try:
        return package_metadata.version("criticalkv")
    except package_metadata.PackageNotFoundError:
        return "unknown"


def _json_options(method: Method) -> dict[str, Any]:
    """The method's options that survive JSON (numbers, strings, booleans, None)."""
    return {k: v for k, v in method.options().items() if v is None or isinstance(v, (bool, int, float, str))}


def _layer_tensors(i: int, layer: CompressedLayer) -> dict[str, torch.Tensor]:
    if not layer.holds_prompt or layer.keep is None:
        raise ValueError("only a cache that holds a compressed prompt can be saved; prefill it first")
    keep = layer.keep.detach().to("cpu", torch.bool).reshape(-1).numpy()
    tensors = {**layer.storage.file_tensors(), "keep": torch.from_numpy(np.packbits(keep))}
    return {f"{i}.{name}": tensor for name, tensor in tensors.items()}


def _layer_header(layer: CompressedLayer) -> dict[str, Any]:
    assert layer.keep is not None  # checked by _layer_tensors
    return {
        "batch_size": layer.batch_size,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "prompt_len": int(layer.keep.shape[-1]),
        "prefix_len": layer.prefix_len,
        "tail_may_have_padding": layer.tail_may_have_padding,
        "dtype": str(layer.dtype).removeprefix("torch."),
        **layer.storage.file_header(),
    }


def _checksum(tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().to("cpu")
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def save_cache(cache: _Cache, path: str | Path, model: Any, tokenizer: Any = None, **fields: Any) -> int:
    """Write ``cache`` (computed by ``model``, on ids from ``tokenizer``) to ``path``, atomically.

    ``fields`` (JSON values, e.g. ``mode="question-agnostic"``) are stored in the header and
    returned by :func:`read_header`. Returns the file's size in bytes: the cache's
    :meth:`~CompressedCache.kv_bytes` (without spare tail capacity) plus a small header.
    """
    layers = cache.compressed_layers
    if cache.real_prompt_tokens is None or cache.budget_tokens is None:
        raise ValueError("only a cache that holds a compressed prompt can be saved; prefill it first")
    tensors: dict[str, torch.Tensor] = {
        "real_prompt_tokens": cache.real_prompt_tokens,
        "budget_tokens": cache.budget_tokens,
    }
    for i, layer in enumerate(layers):
        tensors.update(_layer_tensors(i, layer))
    tensors = {k: v.detach().contiguous().to("cpu") for k, v in tensors.items()}
    header: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "library_version": library_version(),
        "model": model_fingerprint(model),
        "tokenizer": None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        "method": cache.method.name,
        "method_options": _json_options(cache.method),
        "budget": cache.budget,
        "window": cache.window,
        "storage": storage_options(cache.quantization),
        "num_layers": cache.num_layers,
        "prompt_tokens": [int(n) for n in cache.real_prompt_tokens.tolist()],
        "layers": [_layer_header(layer) for layer in layers],
        "fields": fields,
    }
    header["checksum"] = _checksum(tensors, header)
    target = Path(path)
    save_atomically(tensors, target, {HEADER_KEY: json.dumps(header)})
    return target.stat().st_size


def read_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of a cache file (not verified against its checksum; :func:`load_cache` is)."""
    return _read(Path(path), tensors=False)[0]


def _read(path: Path, tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if not path.is_file():
        raise FileNotFoundError(f"no cache file at {path}")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as opened:
            raw = (opened.metadata() or {}).get(HEADER_KEY)
        loaded = load_file(str(path), device="cpu") if tensors else {}
    except Exception as error:  # safetensors raises its own error types for truncated files
        raise CacheFileError(f"cache file {path} is truncated or corrupted ({error})") from error
    if raw is None:
        raise CacheFileError(f"{path} is a safetensors file but not a criticalkv cache (no {HEADER_KEY!r} header)")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as error:
        raise CacheFileError(f"cache file {path} has a corrupted header ({error})") from error
    if header.get("format") != FORMAT or header.get("format_version") != FORMAT_VERSION:
        raise CacheFileError(
            f"{path} is format {header.get('format')!r} version {header.get('format_version')!r}; this criticalkv "
            f"reads {FORMAT!r} version {FORMAT_VERSION} (saved by criticalkv {header.get('library_version')})"
        )
    return header, loaded


def check_compatible(header: dict[str, Any], model: Any, tokenizer: Any, path: Path | str) -> None:
    """Raise :class:`IncompatibleCacheError` unless ``model`` (and ``tokenizer``) match the file's."""
    saved, mine = header["model"], model_fingerprint(model)
    if saved["hash"] != mine["hash"]:
        differs = [k for k in saved["config"] if saved["config"][k] != mine["config"].get(k)]
        why = f"config fields {', '.join(differs)} differ" if differs else "its weights or dtype differ"
        if not differs and saved.get("dtype") != mine["dtype"]:
            why = f"dtype {saved.get('dtype')} vs {mine['dtype']}"
        raise IncompatibleCacheError(
            f"cache file {path} was saved for another model ({saved.get('name') or 'unnamed'}); this model "
            f"({mine['name'] or 'unnamed'}) does not match: {why}"
        )
    if tokenizer is not None and header.get("tokenizer") is not None:
        theirs, ours = header["tokenizer"], tokenizer_fingerprint(tokenizer)
        if theirs["hash"] != ours["hash"]:
            raise IncompatibleCacheError(
                f"cache file {path} was saved for another tokenizer ({theirs.get('name') or 'unnamed'}, "
                f"{theirs.get('vocab_size')} tokens); this one ({ours['name'] or 'unnamed'}, {ours['vocab_size']} "
                "tokens) has another vocabulary, special tokens or chat template"
            )


def load_cache(
    cls: type[C],
    path: str | Path,
    model: Any,
    tokenizer: Any = None,
    device: torch.device | str | None = None,
) -> C:
    """Read a cache written by :func:`save_cache` for ``model`` (and ``tokenizer``).

    Checks, in this order, that the file is whole (it parses and its checksum matches:
    :class:`CacheFileError`) and that it was saved for this model and tokenizer
    (:class:`IncompatibleCacheError`); nothing is decoded from a file that fails. The tensors
    go to ``device`` (default: the device of the model's input embeddings).
    """
    path = Path(path)
    header, tensors = _read(path)
    expected = header.pop("checksum", None)
    if expected != _checksum(tensors, header):
        raise CacheFileError(f"cache file {path} is corrupted: its checksum does not match its contents")
    check_compatible(header, model, tokenizer, path)
    where = torch.device(device) if device is not None else model.get_input_embeddings().weight.device
    method = get_method(header["method"])
    changed = {k: v for k, v in header["method_options"].items() if method.options().get(k, v) != v}
    bound, storage = bind(method.with_options(**changed), model), header.get("storage", {})
    cache: C = cls.from_spec(header["num_layers"], CacheSpec.of(bound, header["budget"], header["window"], **storage))
    cache.real_prompt_tokens = tensors["real_prompt_tokens"].to(where)
    cache.budget_tokens = tensors["budget_tokens"].to(where)
    for i, (layer, info) in enumerate(zip(cache.compressed_layers, header["layers"], strict=True)):
        _restore_layer(layer, info, {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"{i}.")}, where)
    return cache


def _restore_layer(
    layer: CompressedLayer, info: dict[str, Any], t: dict[str, torch.Tensor], where: torch.device
) -> None:
    b, h = info["batch_size"], info["num_kv_heads"]
    geometry = Geometry(b, h, info["head_dim"], t["keys"].dtype, where)
    layer.storage.restore(geometry, info, t)
    keep_bits = np.unpackbits(t["keep"].numpy(), count=b * h * info["prompt_len"]).astype(bool)
    keep = torch.from_numpy(keep_bits).view(b, h, info["prompt_len"]).to(where)
    layer.restore_shape(geometry, keep, info["prefix_len"], info["tail_may_have_padding"])
