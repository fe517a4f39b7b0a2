"""The quantized cache through ``model.generate``, ``fork``, ``criticalkv.generate``; its bytes; bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.prompts import positions
from tests.conftest import make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer

WINDOW, NEW, GROUP = 6, 12, 4
LENGTHS = [48, 37]
CONTEXT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return ckv.attach(make_tiny("llama"))


def quantized(
    model: PreTrainedModel, bits: int = 4, method: str = "critical-adakv", **kw: object
) -> ckv.CompressedCache:
    options: dict[str, object] = {"kv_bits": bits, "kv_group_size": GROUP, "kv_residual": 4, **kw}
    return ckv.CompressedCache.for_model(model, method, 0.3, window=WINDOW, **options)


def generate(model: PreTrainedModel, cache: object, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = model.generate(
        input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False
    )
    return out[:, ids.shape[1] :]


@torch.no_grad()
def greedy_by_hand(
    model: PreTrainedModel, cache: ckv.CompressedCache, ids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    cached = cache.get_seq_length()
    logits = model(
        input_ids=ids[:, cached:], attention_mask=mask, position_ids=positions(mask)[:, cached:], cache=cache
    ).logits
    tokens = []
    for step in range(NEW):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
        if step + 1 == NEW:
            break
        mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], dim=1)
        logits = model(input_ids=token, attention_mask=mask, position_ids=positions(mask)[:, -1:], cache=cache).logits
    return torch.cat(tokens, dim=1)


@pytest.mark.parametrize("bits", [4, 8])
def test_model_generate_equals_greedy_loop(model: PreTrainedModel, bits: int) -> None:
    ids, mask = padded_batch(LENGTHS, seed=0)
    via_generate = generate(model, quantized(model, bits), ids, mask)
    assert via_generate.shape == (2, NEW)
    assert torch.equal(via_generate, greedy_by_hand(model, quantized(model, bits), ids, mask))


@torch.no_grad()
def test_forks_share_the_quantized_prompt(model: PreTrainedModel) -> None:
    ids, mask = padded_batch(LENGTHS, seed=1)
    cache = quantized(model)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    prefix_bytes = cache.kv_bytes()
    g = torch.Generator().manual_seed(4)
    qa, qb = torch.randint(3, 100, (2, 5), generator=g), torch.randint(3, 100, (2, 7), generator=g)
    ones = torch.ones(2, 7, dtype=torch.long)
    out_a = generate(model, cache.fork(), torch.cat([ids, qa], 1), torch.cat([mask, ones[:, :5]], 1))
    out_b = generate(model, cache.fork(), torch.cat([ids, qb], 1), torch.cat([mask, ones], 1))
    assert not torch.equal(out_a, out_b)
    assert cache.kv_bytes() == prefix_bytes  # the forks never wrote to the shared prompt
    again = cache.fork()
    assert isinstance(again.compressed_layers[0], type(cache.compressed_layers[0]))
    assert torch.equal(generate(model, again, torch.cat([ids, qa], 1), torch.cat([mask, ones[:, :5]], 1)), out_a)


@torch.no_grad()
def test_bytes_equal_the_formula_and_shrink(model: PreTrainedModel) -> None:
    """kv_bytes = packed codes + float16 scales and zero points (whole blocks, each head's partial
    block at its real length) + the exact residual."""
    ids, mask = padded_batch(LENGTHS, seed=2)
    sizes = {}
    for bits in (16, 8, 4):
        cache = (
            quantized(model, bits)
            if bits < 16
            else ckv.CompressedCache.for_model(model, "critical-adakv", 0.3, window=WINDOW)
        )
        generate(model, cache, ids, mask)
        sizes[bits] = cache.kv_bytes()
        if bits == 16:
            full_bytes = cache.kv_bytes_full()
            continue
        assert cache.kv_bytes_full() == full_bytes  # the unquantized full cache, whatever kv_bits
        expected, partial = 0, 0
        for layer in cache.compressed_layers:
            d, s = layer.head_dim, layer.batch_size * layer.num_kv_heads
            lengths = layer.storage.prefix.lengths  # type: ignore[union-attr]
            per_entry = 2 * d * bits // 8 + 2 * (d // GROUP) * 2
            blocks = int((lengths // GROUP).sum()) + int((lengths % GROUP > 0).sum())
            partial += int((lengths % GROUP > 0).sum())
            expected += int(lengths.sum()) * per_entry + 2 * blocks * d * 2
            tail = s * layer.storage.tail_blocks.num_blocks  # type: ignore[attr-defined]
            expected += tail * (GROUP * per_entry + 2 * d * 2)
            expected += 2 * layer.storage.residual_keys.numel() * 4  # type: ignore[attr-defined]  # float32 residual
        assert partial > 0  # the formula covers partial blocks
        assert cache.kv_bytes() == expected
    assert sizes[4] < sizes[8] < sizes[16]


def test_criticalkv_generate_reports_bits() -> None:
    tiny, tokenizer = make_tiny("llama"), char_tokenizer()
    kwargs = {"window": 4, "max_new_tokens": 6, "chat": False, "method": "snapkv", "budget": 0.5}
    plain = ckv.generate(tiny, tokenizer, [CONTEXT, CONTEXT[:90]], ["Who?", "What jumps?"], **kwargs)
    four = ckv.generate(
        tiny, tokenizer, [CONTEXT, CONTEXT[:90]], ["Who?", "What jumps?"], kv_bits=4, kv_group_size=8, **kwargs
    )
    assert plain.kv_bits == 16 and four.kv_bits == 4
    assert plain.storage_bits == 32 and four.storage_bits == 4  # the tiny model is float32
    assert plain.kv_bits_per_element is not None and plain.kv_bits_per_element >= 32  # float32 + spare tail
    assert four.kv_bits_per_element is not None and four.kv_bits_per_element < plain.kv_bits_per_element / 2
    assert plain.kv_bits_per_element_final is not None and four.kv_bits_per_element_final is not None
    assert four.kv_bytes < plain.kv_bytes and four.kv_bytes_full == plain.kv_bytes_full


def test_bits_per_element_is_the_first_tokens_on_kv_bytes() -> None:
    """Issue 29, point 3: the figure is computed on what ``kv_bytes`` holds (the prompt's entries at the
    first token), not on the final bytes with the decode tail's full-precision residual; the end has its own."""
    tiny, tokenizer = make_tiny("llama"), char_tokenizer()
    kwargs = {"window": 4, "max_new_tokens": 12, "min_new_tokens": 12, "chat": False, "method": "snapkv"}
    four = ckv.generate(tiny, tokenizer, CONTEXT, "Who?", budget=0.5, kv_bits=4, kv_group_size=8, **kwargs)
    layers, kv_heads, head_dim = 3, 2, 16  # tests/conftest.py's tiny model
    entries_at_first = layers * kv_heads * (four.context_tokens[0] + four.question_tokens[0])  # upper bound
    assert four.kv_bits_per_element is not None and four.kv_bits_per_element_final is not None
    assert four.kv_bits_per_element >= 8 * four.kv_bytes / (2 * head_dim * entries_at_first)
    assert four.kv_bits_per_element < four.kv_bits_per_element_final  # the end adds the exact residual


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"kv_bits": 5}, "kv_bits must be 16"),
        ({"kv_bits": 4, "kv_group_size": 6}, "does not divide the head dimension 16"),
        ({"kv_bits": 4, "kv_group_size": 8, "kv_residual": 100}, "longer than the budget"),
        ({"kv_bits": 4, "kv_group_size": 8, "kv_residual": 8, "decode_budget": 6}, "longer than the decode budget"),
    ],
)
def test_generate_refuses_before_the_model_runs(options: dict[str, int], message: str) -> None:
    tiny, tokenizer = make_tiny("llama"), char_tokenizer()
    calls = []
    tiny.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match=message):
        ckv.generate(tiny, tokenizer, CONTEXT, "Who?", window=4, chat=False, method="snapkv", budget=0.3, **options)  # type: ignore[arg-type]
    assert not calls


def test_cache_refuses_bad_options(model: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match="does not divide the head dimension 16"):
        ckv.CompressedCache.for_model(model, "snapkv", 0.3, kv_bits=4, kv_group_size=5)
    with pytest.raises(ValueError, match="longer than the budget"):
        ckv.CompressedCache.for_model(model, "snapkv", 8, kv_bits=4, kv_group_size=8, kv_residual=9)
    with pytest.raises(ValueError, match="longer than the decode budget"):
        ckv.CompressedCache.for_model(model, "snapkv", 0.3, kv_bits=8, kv_group_size=8, kv_residual=9, decode_budget=8)
    with pytest.raises(TypeError, match="kv_bits must be an integer"):
        ckv.CompressedCache.for_model(model, "snapkv", 0.3, kv_bits=4.0)


@torch.no_grad()
def test_row_reordering_is_refused(model: PreTrainedModel) -> None:
    ids, mask = padded_batch(LENGTHS, seed=0)
    cache = quantized(model)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    with pytest.raises(ValueError, match="cannot reorder or repeat its rows"):
        cache.batch_repeat_interleave(2)


def test_sweep_identity_records_kv_bits_only_when_set(tmp_path: object) -> None:
    from criticalkv.eval.sweep import SweepConfig

    common = {"tasks": ["niah_single_1"], "lengths": [256], "samples": 1, "model": "tiny"}
    plain = SweepConfig(out=f"{tmp_path}/a", **common)  # type: ignore[arg-type]
    four = SweepConfig(out=f"{tmp_path}/b", kv_bits=4, **common)  # type: ignore[arg-type]
    assert "kv_bits" not in plain.identity() and "kv_bits" not in plain.to_json()
    assert four.identity()["kv_bits"] == 4 and four.to_json()["kv_bits"] == 4
    with pytest.raises(ValueError, match="kv_bits must be 16"):
        SweepConfig(out=f"{tmp_path}/c", kv_bits=3, **common)  # type: ignore[arg-type]


@torch.no_grad()
def test_the_torch_reference_dequantizes_a_chunk_at_a_time(
    model: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No dequantization covers more than a chunk of sequences (CHUNK_ENTRIES padded entries, or
    one longer sequence): the layer is never held in full precision. (The op's torch reference;
    the C kernel reads one entry at a time.)"""
    from criticalkv.ops import reference

    monkeypatch.setenv("CRITICALKV_KERNEL", "torch")
    monkeypatch.setattr(reference, "CHUNK_ENTRIES", 8)
    spans: list[int] = []
    real = reference.dequantized

    def spy(pool: torch.Tensor, rows: torch.Tensor, *args: object) -> torch.Tensor:
        spans.append(int(rows.numel()))
        return real(pool, rows, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(reference, "dequantized", spy)
    ids, mask = padded_batch(LENGTHS, seed=3)
    cache = ckv.CompressedCache.for_model(model, "full", 1.0, window=WINDOW, kv_bits=4, kv_group_size=4)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    model(input_ids=ids[:, -1:], attention_mask=step, position_ids=positions(step)[:, -1:], cache=cache)
    layer = cache.compressed_layers[0]
    prefix = layer.storage.prefix  # type: ignore[union-attr]
    widest = -(-int(prefix.lengths.max()) // 4) * 4  # one sequence's padded entries
    stored = int(prefix.lengths.sum())
    assert spans and max(spans) <= max(8, widest) < stored
