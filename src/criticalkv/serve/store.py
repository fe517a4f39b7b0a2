"""The stored contexts: compressed caches under a byte cap in memory, every one also on disk.

A context is written to the store folder before its creation is acknowledged (so a server
killed afterwards finds it again); memory holds the most recently used ones up to the cap,
the others are read back (:meth:`CompressedCache.load`) when a request needs them. The folder
is the truth: servers sharing it (Ray Serve replicas) find the contexts the others stored, and
a context whose file is gone is gone for all.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from criticalkv.cache import CacheSpec
from criticalkv.cache.compressed_cache import CompressedCache
from criticalkv.cache.persist import IncompatibleCacheError, model_fingerprint, read_header, tokenizer_fingerprint
from criticalkv.serve.errors import APIError, not_found
from criticalkv.serve.row_memory import token_bytes

logger = logging.getLogger(__name__)

SUFFIX = ".ckv"
#: beside each stored file, the checksum of the file as this store wrote it
SUM_SUFFIX = ".sum"
_ID = re.compile(r"^ctx_[0-9a-f]{24}$")
#: temporaries of interrupted writes (a killed server's); one untouched this long is nobody's
_TEMPORARIES = (f".ctx_*{SUFFIX}.*.tmp", f"ctx_*{SUM_SUFFIX}.tmp")
STALE_TEMPORARY_S = 60.0


def new_id() -> str:
    return "ctx_" + secrets.token_hex(12)


@dataclass
class StoredContext:
    """One stored context: what its creation answered (``spec``: how it was compressed and is
    stored), and its cache while in memory."""

    id: str
    tokens: int
    kv_bytes: int
    spec: CacheSpec
    created: int
    cache: CompressedCache | None = None
    kv_bytes_full: int = 0  # what the same tokens take uncompressed, in the model's dtype
    refused: str | None = None  # why this server cannot answer it (stored for another model or tokenizer)

    def info(self) -> dict[str, Any]:
        info = {
            "id": self.id,
            "object": "context",
            "tokens": self.tokens,
            "kv_bytes": self.kv_bytes,
            "kv_bytes_full": self.kv_bytes_full,
            "kv_ratio": round(self.kv_bytes / self.kv_bytes_full, 4) if self.kv_bytes_full else None,
            "method": self.spec.method.name,
            "budget": self.spec.budget,
            "window": self.spec.window,
            "kv_bits": self.spec.kv_bits,  # the storage precision: 16, the model's dtype; 8 or 4, quantized
            "created": self.created,
            "in_memory": self.cache is not None,
            "status": "ready",
            "answerable": self.refused is None,
        }
        if self.refused is not None:
            info["reason"] = self.refused
        return info

    def check_answerable(self) -> None:
        """A 409 naming the mismatch unless this server's model and tokenizer made the context."""
        if self.refused is not None:
            raise APIError(409, self.refused, param="context_id", code="context_incompatible")


class ContextStore:
    """Contexts by id, at most ``cap_bytes`` of keys and values in memory (LRU), all in ``folder``."""

    def __init__(self, folder: Path, cap_bytes: int, model: Any, tokenizer: Any) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cap_bytes = cap_bytes
        self.model, self.tokenizer = model, tokenizer
        self._model_print = model_fingerprint(model)
        self._tokenizer_print = tokenizer_fingerprint(tokenizer)
        self._full_per_token = token_bytes(model)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, StoredContext] = OrderedDict()  # least recently used first
        self._clean_temporaries()
        self._reload()

    def _clean_temporaries(self) -> None:
        """Delete what interrupted writes left (a server killed mid-save): temporaries untouched for
        :data:`STALE_TEMPORARY_S` seconds (a server sharing the folder may be writing a newer one)."""
        now = time.time()
        for pattern in _TEMPORARIES:
            for path in self.folder.glob(pattern):
                try:
                    if now - path.stat().st_mtime > STALE_TEMPORARY_S:
                        size = path.stat().st_size
                        path.unlink()
                        logger.info(
                            "store %s: removed %s (%d bytes) an interrupted write left", self.folder, path, size
                        )
                except FileNotFoundError:  # removed meanwhile
                    continue

    def _mismatch(self, context_id: str, header: dict[str, Any]) -> str | None:
        """Why this server's model or tokenizer cannot answer the context ``header`` describes."""
        saved = header.get("model") or {}
        if saved.get("hash") != self._model_print["hash"]:
            differs = [k for k, v in (saved.get("config") or {}).items() if self._model_print["config"].get(k) != v]
            why = f"config fields {', '.join(differs)} differ" if differs else "its weights or dtype differ"
            return (
                f"context {context_id} was made for another model ({saved.get('name') or 'unnamed'}: {why}); "
                "this server cannot answer it: create it again here, or serve the model that made it"
            )
        theirs = header.get("tokenizer")
        if theirs is not None and theirs.get("hash") != self._tokenizer_print["hash"]:
            return (
                f"context {context_id} was made with another tokenizer ({theirs.get('name') or 'unnamed'}, "
                f"{theirs.get('vocab_size')} tokens); this server cannot answer it: create it again here"
            )
        return None

    def _path(self, context_id: str) -> Path:
        return self.folder / f"{context_id}{SUFFIX}"

    def _reload(self) -> None:
        """Register the contexts a previous server left in the folder (read back on demand)."""
        for path in sorted(self.folder.glob(f"ctx_*{SUFFIX}")):
            entry = self._read_entry(path)
            if entry is not None:
                self._entries[entry.id] = entry
        logger.info("store %s: %d contexts on disk", self.folder, len(self._entries))

    def _read_entry(self, path: Path) -> StoredContext | None:
        """The context whose file is ``path`` (header only), or None if it is not a readable one,
        is a symbolic link, or holds another id than the one it is stored under (a swapped or
        renamed file: the store trusts only what it wrote under that name)."""
        try:
            if path.is_symlink():
                logger.warning("skipping %s: a symbolic link (the store follows none)", path)
                return None
            header = read_header(path)
            fields = header["fields"]
            if fields.get("id") != path.name.removesuffix(SUFFIX):
                logger.warning("skipping %s: it holds context %r, not the one its name says", path, fields.get("id"))
                return None
            if not self._written_here(str(fields["id"]), header):
                logger.warning("skipping %s: its checksum is not the one recorded when it was written", path)
                return None
            return StoredContext(
                **{k: fields[k] for k in ("id", "tokens", "kv_bytes")},
                spec=CacheSpec.from_record({**fields, **(header.get("storage") or {})}),
                created=fields["created"],
                kv_bytes_full=int(fields.get("kv_bytes_full") or fields["tokens"] * self._full_per_token),
                refused=self._mismatch(str(fields["id"]), header),
            )
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as error:
            logger.warning("skipping %s: not a readable stored context (%s)", path, error)
            return None

    # --- what the event loop asks (quick, under the lock) ------------------------------------
    def info(self, context_id: str) -> dict[str, Any]:
        with self._lock:
            return self._entry(context_id).info()

    def spec(self, context_id: str) -> CacheSpec:
        """How the context ``context_id`` was compressed and is stored (a 404 if it is not here)."""
        with self._lock:
            return self._entry(context_id).spec

    def infos(self) -> list[dict[str, Any]]:
        """Every stored context's description (the folder decides, as for :meth:`info`), oldest first."""
        ids = [p.name.removesuffix(SUFFIX) for p in self.folder.glob(f"ctx_*{SUFFIX}")]
        out = []
        with self._lock:
            for context_id in ids:
                try:
                    out.append(self._entry(context_id).info())
                except APIError:  # deleted meanwhile, or not a readable context
                    continue
        return sorted(out, key=lambda info: (info["created"], info["id"]))

    def has(self, context_id: str) -> bool:
        with self._lock:
            try:
                self._entry(context_id)
            except APIError:
                return False
            return True

    def delete(self, context_id: str) -> None:
        with self._lock:
            self._entry(context_id)
            del self._entries[context_id]
            self._path(context_id).unlink(missing_ok=True)
            self._path(context_id).with_suffix(SUM_SUFFIX).unlink(missing_ok=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            held = [e for e in self._entries.values() if e.cache is not None]
            return {
                "in_memory": len(held),
                "on_disk": len(self._entries),
                "bytes_in_memory": sum(e.kv_bytes for e in held),
                "bytes_total": sum(e.kv_bytes for e in self._entries.values()),
                "bytes_full_total": sum(e.kv_bytes_full for e in self._entries.values()),
                "cap_bytes": self.cap_bytes,
            }

    def _entry(self, context_id: str) -> StoredContext:
        """The entry of ``context_id``; the folder decides, so servers sharing it see each other's."""
        entry = None
        if _ID.match(context_id):
            path = self._path(context_id)
            if not path.is_file():  # never stored, or deleted (perhaps by another server on this folder)
                self._entries.pop(context_id, None)
            else:
                entry = self._entries.get(context_id) or self._read_entry(path)
                if entry is not None and context_id not in self._entries:
                    self._entries[context_id] = entry  # stored by another server sharing the folder
        if entry is None:
            raise not_found(f"no context {context_id!r}; create one with POST /v1/contexts", "context_id")
        return entry

    # --- what the worker does -------------------------------------------------------------------
    def add(
        self,
        cache: CompressedCache,
        tokens: int,
        spec: CacheSpec,
        context_id: str | None = None,
    ) -> StoredContext:
        """Store a freshly compressed context (``spec``: its options; under ``context_id``, or a new
        id): on disk first, then in memory (spilling others). The file's header records the storage
        (:meth:`CompressedCache.save`), the fields the rest of :meth:`StoredContext.info`."""
        kv = cache.kv_bytes()
        if kv > self.cap_bytes:
            raise APIError(
                413,
                f"the compressed context needs {kv} bytes, more than the server's memory cap "
                f"({self.cap_bytes} bytes); use a smaller budget or a shorter document",
                param="text",
                code="context_too_large",
            )
        entry = StoredContext(context_id or new_id(), tokens, kv, spec, int(time.time()))
        entry.kv_bytes_full = cache.kv_bytes_full() or tokens * self._full_per_token
        skip = ("object", "in_memory", "kv_bits", "status", "kv_ratio", "answerable")
        fields = {k: v for k, v in entry.info().items() if k not in skip}
        try:
            cache.save(self._path(entry.id), self.model, self.tokenizer, mode="question-agnostic", **fields)
            self._record_checksum(entry.id)
        except (OSError, SafetensorError) as error:
            raise self._unwritable(entry.id, error) from None
        with self._lock:
            self._entries[entry.id] = entry
            self._hold(entry, cache)
        return entry

    def _unwritable(self, context_id: str, error: Exception) -> APIError:
        """A 507 saying, in a sentence about the disk, that the context could not be stored."""
        for path in (self._path(context_id), self._path(context_id).with_suffix(SUM_SUFFIX)):
            path.unlink(missing_ok=True)  # nothing half-stored is listed
        full = "No space left" in str(error) or "StorageFull" in str(error) or getattr(error, "errno", None) == 28
        logger.error("store %s: writing context %s failed: %s", self.folder, context_id, error)
        why = "the disk is full" if full else f"the write failed: {type(error).__name__}"
        return APIError(
            507,
            f"the context could not be stored in {self.folder} ({why}); free some space there, delete "
            "contexts (DELETE /v1/contexts/{id}) or start the server with another --store",
            param="text",
            code="store_full" if full else "store_unwritable",
            type="server_error",
        )

    def get(self, context_id: str) -> tuple[StoredContext, CompressedCache]:
        """The context's cache (read back from disk if it was spilled), now the most recently used."""
        with self._lock:
            entry = self._entry(context_id)
            entry.check_answerable()
            self._entries.move_to_end(context_id)
            if entry.cache is not None:
                return entry, entry.cache
        try:
            self._check_file(context_id)
            cache = CompressedCache.load(self._path(context_id), self.model, self.tokenizer)
        except IncompatibleCacheError as error:  # replaced on disk by another server's file
            raise APIError(409, str(error), param="context_id", code="context_incompatible") from None
        except FileNotFoundError:  # deleted meanwhile, by another server sharing the folder
            with self._lock:
                self._entries.pop(context_id, None)
            raise not_found(f"context {context_id!r} was deleted", "context_id") from None
        with self._lock:
            if context_id in self._entries:
                self._hold(entry, cache)
        return entry, cache

    def _record_checksum(self, context_id: str) -> None:
        """Note the checksum of the file this server just wrote (``<id>.sum``, written atomically)."""
        path = self._path(context_id)
        note = path.with_suffix(SUM_SUFFIX)
        temporary = note.with_name(note.name + ".tmp")
        temporary.write_text(str(read_header(path).get("checksum")), encoding="utf-8")
        os.replace(temporary, note)

    def _written_here(self, context_id: str, header: dict) -> bool:
        """Whether ``header`` carries the checksum recorded when the file was written (no record:
        a store written before records existed, trusted by its id alone)."""
        note = self._path(context_id).with_suffix(SUM_SUFFIX)
        return not note.is_file() or note.read_text(encoding="utf-8").strip() == str(header.get("checksum"))

    def _check_file(self, context_id: str) -> None:
        """A 409 unless the file stored under ``context_id`` is a plain file holding that context,
        with the checksum recorded when it was written."""
        path = self._path(context_id)
        header = {} if path.is_symlink() else read_header(path)
        held = header.get("fields", {}).get("id")
        if held == context_id and not self._written_here(context_id, header):
            held = f"{context_id} (another file: its checksum is not the one recorded)"
        if held != context_id:
            logger.warning("refusing %s: it holds context %r, not %r (swapped or linked)", path, held, context_id)
            raise APIError(
                409,
                f"the stored file of context {context_id!r} holds another context (it was replaced on disk); "
                "create the context again with POST /v1/contexts",
                param="context_id",
                code="context_replaced",
            )

    def _hold(self, entry: StoredContext, cache: CompressedCache) -> None:
        """Keep ``entry`` in memory, spilling the least recently used others to stay under the cap."""
        entry.cache = cache
        self._entries.move_to_end(entry.id)
        used = sum(e.kv_bytes for e in self._entries.values() if e.cache is not None)
        for other in list(self._entries.values()):
            if used <= self.cap_bytes:
                break
            if other is not entry and other.cache is not None:
                other.cache = None  # its file is already on disk
                used -= other.kv_bytes
                logger.debug("spilled %s (%d bytes) to disk", other.id, other.kv_bytes)
