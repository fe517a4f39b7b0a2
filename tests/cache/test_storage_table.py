"""The storage table (cache/storage_table.py): each storage spec type builds its storage, an unknown
spec is refused in one sentence, and a new storage registered by one line of the table is what every
layer of a cache holds, decoding as the storage it extends."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import criticalkv as ckv
from criticalkv.cache import STORAGES, CacheSpec, new_storage, storage_class
from criticalkv.cache.quantized import KVQuantization
from criticalkv.runtime import append_tokens, prefill_into
from tests.conftest import make_tiny, padded_batch


@pytest.mark.parametrize("spec", [None, KVQuantization(8), KVQuantization(4, 16, 2)])
def test_each_spec_builds_its_own_storage_and_an_empty_one_of_the_same_kind(spec: KVQuantization | None) -> None:
    storage = new_storage(spec)
    assert type(storage) is storage_class(spec) is STORAGES[type(spec)]
    assert storage.spec == spec
    empty = storage.empty()
    assert type(empty) is type(storage) and empty.spec == spec and empty is not storage


def test_an_unknown_storage_spec_is_refused_in_one_sentence() -> None:
    with pytest.raises(TypeError, match=r"^no storage holds a str storage spec \(known: NoneType, KVQuantization\)"):
        new_storage("fp8")


@dataclass(frozen=True)
class CountingSpec:
    """A new storage's spec: nothing but its type."""


class CountingStorage(STORAGES[type(None)]):  # type: ignore[misc,valid-type]
    """A new storage: the 16-bit one, counting its appends."""

    def __init__(self, spec: CountingSpec | None = None) -> None:
        super().__init__(None)
        self.spec = spec
        self.appends = 0

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.appends += 1
        super().append(keys, values)


@torch.no_grad()
def test_a_storage_registered_by_one_line_is_what_every_layer_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(STORAGES, CountingSpec, CountingStorage)  # the one line of a new storage
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([30, 24], seed=1)
    question = torch.tensor([[5, 9, 13]] * 2)
    logits = []
    for storage in (None, CountingSpec()):
        spec = CacheSpec(ckv.get_method("snapkv"), 0.5, 4, None, storage)  # type: ignore[arg-type]
        cache = ckv.CompressedCache.from_spec(model.config.num_hidden_layers, spec)
        prefill_into(model, cache, ids, mask)
        out, _ = append_tokens(model, cache, mask, question)
        logits.append(out.logits)
        kinds = {type(layer.storage) for layer in cache.compressed_layers}
        assert kinds == {storage_class(storage)}
    assert all(layer.storage.appends == 1 for layer in cache.compressed_layers)
    assert torch.equal(logits[0], logits[1])
