"""The per-bit-width default group size: 32 at 8 bits, 64 at 4 bits, everywhere a group can be left out."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

import criticalkv as ckv
from criticalkv.bench.record import storage_fields
from criticalkv.cache.quantized import DEFAULT_GROUP_SIZES, KVQuantization, default_group_size, quantization_for
from criticalkv.cli import build_parser
from criticalkv.eval.sweep import SweepConfig
from criticalkv.runtime.forward import append_tokens, prefill_into
from tests.conftest import VOCAB, make_tiny


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return ckv.attach(make_tiny("llama"))  # head_dim 16: groups 32 and 64 are multiples of it


def test_each_bit_width_has_its_default() -> None:
    assert DEFAULT_GROUP_SIZES == {8: 32, 4: 64}
    assert (default_group_size(8), default_group_size(4)) == (32, 64)
    assert KVQuantization(8).group_size == 32 and KVQuantization(4).group_size == 64
    spec8, spec4 = quantization_for(8), quantization_for(4)
    assert spec8 is not None and spec8.group_size == 32
    assert spec4 is not None and spec4.group_size == 64


def test_the_default_and_the_same_group_given_are_one_spec() -> None:
    assert KVQuantization(8) == KVQuantization(8, 32) and hash(KVQuantization(8)) == hash(KVQuantization(8, 32))
    assert KVQuantization(8) != KVQuantization(8, 64)
    assert KVQuantization(4, 32).group_size == 32  # an explicit group is kept
    assert quantization_for(8, None, 4) == KVQuantization(8, 32, 4)


@pytest.mark.parametrize("bits", [16, 2, True])
def test_no_default_for_other_widths(bits: int) -> None:
    with pytest.raises(ValueError, match="8 or 4 bits"):
        default_group_size(bits)


def _help(command: str) -> str:
    parser = build_parser()
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        choices = getattr(action, "choices", None) or {}
        if command in choices:
            return str(choices[command].format_help())
    raise AssertionError(f"no {command} subcommand")


@pytest.mark.parametrize("command", ["eval", "bench", "generate"])
def test_help_says_the_real_defaults(command: str) -> None:
    text = " ".join(_help(command).split())
    assert "zero point (default 32 at 8 bits, 64 at 4 bits)" in text


def test_bench_records_the_group_in_effect() -> None:
    """Bench records spell the storage with its group size resolved (and every field ``None`` unquantized)."""
    assert storage_fields(KVQuantization(8)) == {"kv_bits": 8, "kv_group_size": 32, "kv_residual": None}
    assert storage_fields(KVQuantization(4, residual=4)) == {"kv_bits": 4, "kv_group_size": 64, "kv_residual": 4}
    assert storage_fields(KVQuantization(8, 16))["kv_group_size"] == 16
    assert storage_fields(None) == {"kv_bits": None, "kv_group_size": None, "kv_residual": None}


def test_sweep_identity_records_the_group_in_effect(tmp_path: Path) -> None:
    """Left out, the identity records the bit width's default; given, the group given."""
    common: dict[str, object] = dict(tasks=["niah_single_1"], methods=["full", "snapkv"], budgets=[0.2])
    default = SweepConfig(out=tmp_path / "a", kv_bits=8, **common)  # type: ignore[arg-type]
    assert default.identity()["kv_group_size"] == 32 and default.cache == {"kv_bits": 8}
    assert SweepConfig(out=tmp_path / "b", kv_bits=4, **common).identity()["kv_group_size"] == 64  # type: ignore[arg-type]
    given = SweepConfig(out=tmp_path / "c", kv_bits=8, kv_group_size=64, **common)  # type: ignore[arg-type]
    assert given.identity()["kv_group_size"] == 64
    assert "kv_group_size" not in SweepConfig(out=tmp_path / "d", **common).identity()  # type: ignore[arg-type]


def test_a_folder_made_under_an_older_default_does_not_resume(tmp_path: Path) -> None:
    """An 8-bit folder recorded without a group (made when the default was 64) is refused, not mixed."""
    from criticalkv.eval.results import LAYOUT
    from criticalkv.runs.folder import open_folder

    config = SweepConfig(out=tmp_path, tasks=["niah_single_1"], methods=["snapkv"], budgets=[0.2], kv_bits=8)
    older = {k: v for k, v in config.identity().items() if k != "kv_group_size"}
    open_folder(tmp_path, LAYOUT, older)
    (tmp_path / "results.jsonl").write_text('{"task": "niah_single_1"}\n')  # it holds results: protected
    with pytest.raises(ValueError, match=r"kv_group_size: None there, 32 now.*use another --out"):
        open_folder(tmp_path, LAYOUT, config.identity())
    open_folder(tmp_path / "same", LAYOUT, config.identity())
    open_folder(tmp_path / "same", LAYOUT, config.identity())  # the same grouping resumes


@torch.no_grad()
def test_cache_default_stores_as_the_explicit_group(model: PreTrainedModel) -> None:
    """An 8-bit cache left at the default holds exactly the bytes and logits of one given group 32."""
    ids = torch.randint(3, VOCAB, (1, 90), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    results = {}
    for group in (None, 32, 64):
        cache = ckv.CompressedCache.for_model(model, "snapkv", 0.5, window=8, kv_bits=8, kv_group_size=group)
        logits = prefill_into(model, cache, ids, mask)
        step = append_tokens(model, cache, mask, ids[:, -1:])[0].logits
        assert cache.quantization is not None
        results[group] = (cache.quantization.group_size, cache.kv_bytes(), logits, step)
    assert results[None][0] == 32 and results[64][0] == 64
    assert results[None][1] == results[32][1] != results[64][1]
    torch.testing.assert_close(results[None][3], results[32][3], rtol=0, atol=0)
