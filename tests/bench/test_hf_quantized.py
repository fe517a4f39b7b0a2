"""transformers' own ``QuantizedCache`` beside ours: backend choice, its real bytes, and the fidelity
path of ``benchmarks/hf_quantized_fidelity.py`` on a tiny model (skipped where hqq does not import)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import DynamicCache, PreTrainedModel

from criticalkv.bench.hf_quantized import backend_unavailable, hf_quantized_cache, pick_backend
from criticalkv.bench.ours import cache_bits_per_element, dynamic_cache_bytes, state_bytes
from criticalkv.cache.quantized import KVQuantization
from criticalkv.eval.sweep import SampleEvaluator, SweepConfig
from criticalkv.runtime.forward import prefill_into
from tests.conftest import VOCAB, make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

HQQ = backend_unavailable("hqq", 4)
needs_hqq = pytest.mark.skipif(HQQ is not None, reason=f"hqq does not import here: {HQQ}")


def _load() -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_quantized_fidelity.py"
    spec = importlib.util.spec_from_file_location("hf_quantized_fidelity_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return make_tiny("llama")  # 2 KV heads, head_dim 16, float32


def test_bit_widths_each_backend_refuses() -> None:
    assert "stores 2, 4 bits, not 8" in str(backend_unavailable("quanto", 8))
    assert "stores 1, 2, 3, 4, 8 bits, not 16" in str(backend_unavailable("hqq", 16))
    backend, reason = pick_backend(16)
    assert backend is None and reason is not None and "quanto" in reason and "hqq" in reason
    with pytest.raises(ValueError, match="backends are quanto, hqq"):
        backend_unavailable("fp16", 4)
    assert state_bytes(None) == 0 and state_bytes(torch.zeros(3, 2)) == 24
    codes, scale = torch.zeros(8, dtype=torch.uint8), torch.zeros(2)
    assert state_bytes((codes, {"scale": scale, "zero": scale, "shape": torch.Size([4, 4]), "nbits": 4})) == 8 + 16


def test_an_empty_namespace_package_is_not_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """An uninstall can leave ``optimum/quanto`` importable but empty: that is no quanto backend."""
    monkeypatch.setitem(sys.modules, "optimum.quanto", ModuleType("optimum.quanto"))
    reason = backend_unavailable("quanto", 4)
    assert reason is not None and "AttributeError" in reason and "pip install optimum-quanto" in reason


@needs_hqq
def test_hqq_is_picked_for_8_bits_and_where_quanto_is_absent() -> None:
    assert pick_backend(8) == ("hqq", None)  # quanto has no 8 bits
    if backend_unavailable("quanto", 4) is not None:
        assert pick_backend(4) == ("hqq", None)


@needs_hqq
@pytest.mark.parametrize(("bits", "group"), [(8, 32), (4, 64), (4, 16)])
def test_hqq_bytes_are_codes_plus_float32_scales_and_zeros(model: PreTrainedModel, bits: int, group: int) -> None:
    cache = hf_quantized_cache(model, "hqq", bits, group, 8)
    b, h, t, d = 1, 2, 40, 16
    g = torch.Generator().manual_seed(0)
    for layer in range(model.config.num_hidden_layers):
        cache.update(torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g), layer)
    n = b * h * t * d  # elements per tensor; a scale and a zero point (float32) per group of ``group``
    per_tensor = n * bits // 8 + 2 * (n // group) * 4
    assert dynamic_cache_bytes(cache) == 2 * model.config.num_hidden_layers * per_tensor
    assert cache_bits_per_element(cache, b, h * d) == pytest.approx(8 * per_tensor / n)  # bits + 64 / group
    cache.update(torch.randn(b, h, 3, d, generator=g), torch.randn(b, h, 3, d, generator=g), 0)  # 3 exact tokens
    assert dynamic_cache_bytes(cache) == 2 * model.config.num_hidden_layers * per_tensor + 2 * b * h * 3 * d * 4


def test_bits_per_element_of_a_dynamic_cache(model: PreTrainedModel) -> None:
    """float32 keys and values: 32 bits over every entry held; nothing held: ``None``."""
    cache = DynamicCache(config=model.config)
    width = model.config.num_key_value_heads * model.config.head_dim
    assert cache_bits_per_element(cache, 2, width) is None
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        prefill_into(model, cache, ids, torch.ones_like(ids))
    assert cache_bits_per_element(cache, 2, width) == 32.0
    assert cache_bits_per_element(cache, 1, width) == 64.0  # the batch counts: bytes over (rows x entries)


@needs_hqq
def test_refuses_bad_settings(model: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match="stores 1, 2, 3, 4, 8 bits, not 5"):
        hf_quantized_cache(model, "hqq", 5, 32, 8)
    with pytest.raises(ValueError, match="group size must be a positive integer"):
        hf_quantized_cache(model, "hqq", 4, 0, 8)
    with pytest.raises(ValueError, match="residual_length must be a positive integer"):
        hf_quantized_cache(model, "hqq", 4, 16, 0)


@needs_hqq
def test_fidelity_records_pair_with_eval(model: PreTrainedModel, tmp_path: Path) -> None:
    """The full cache's NLL is eval's on the same sample; 8 bits is closer to it than 4 bits; bytes as stored."""
    script = _load()
    tokenizer = char_tokenizer()
    config = SweepConfig(
        out=tmp_path / "sweep", tasks=["niah_single_1"], lengths=[400], methods=["full"], samples=1,
        max_new_tokens=4, window=8,
    )  # fmt: skip
    length, sample = next(iter(config.iter_samples(tokenizer)))
    records = script.sample_records(
        model, tokenizer, length, sample, bits=[8, 4], groups={8: 16, 4: 16}, residual=8, max_new_tokens=4
    )
    full, eight, four = records
    assert [r["kv_bits"] for r in records] == [32, 8, 4] and full["backend"] == "full"
    (evaluated,) = SampleEvaluator(config, model, tokenizer).run(length, sample, [("full", 1.0)])
    assert full["nll"] == pytest.approx(evaluated["nll"], abs=1e-4)
    assert full["score"] == evaluated["score"] and full["prediction"] == evaluated["prediction"]
    assert 0 <= eight["kl"] < four["kl"] and eight["top1"] >= four["top1"] - 1e-9
    # the prompt's bytes: float32 scale and zero per 16 elements = 4 bits on top of the codes
    assert eight["bits_per_element"] == pytest.approx(8 + 4) and four["bits_per_element"] == pytest.approx(4 + 4)
    assert all(0.0 <= r["score"] <= 1.0 and isinstance(r["prediction"], str) for r in records)


def test_script_is_importable_without_hqq() -> None:
    """The script imports wherever criticalkv does; only running a quantized cache needs the backend."""
    assert callable(_load().sample_records)


@needs_hqq
def test_the_kvpress_pairing_falls_back_to_hqq(model: PreTrainedModel) -> None:
    """``bench --kv-bits 8`` pairs kvpress with an HQQ cache (quanto has no 8 bits); the residual
    left unset is ours (64)."""
    from criticalkv.bench.kvpress_quantized import pair_unavailable, quantized_cache

    assert pair_unavailable(8) is None
    cache, backend = quantized_cache(model, KVQuantization(8, 16))
    assert backend == "hqq" and cache.layers[0].residual_length == 64 and cache.layers[0].q_group_size == 16
    ids = torch.randint(3, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the runtime's call: the cache keyword differs across transformers versions
        prefill_into(model, cache, ids, torch.ones_like(ids))
    n = 2 * 40 * 16  # one row, 2 KV heads, 40 tokens, head_dim 16
    assert dynamic_cache_bytes(cache) == 2 * model.config.num_hidden_layers * (n + 2 * (n // 16) * 4)
