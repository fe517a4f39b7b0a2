"""Head importance scores: the scoring rules, files (round trip, provenance, bad files), how a
method finds a model's scores, and ``criticalkv head-scores`` end to end on a tiny model."""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import criticalkv as ckv
from criticalkv.analysis.retrieval_heads import (
    RETRIEVAL,
    RETRIEVAL_REASONING,
    ScoringParameters,
    compute_head_scores,
    head_scores_of,
)
from criticalkv.cli import main
from criticalkv.headscores import HeadScores, architecture, find_head_scores, load_head_scores
from criticalkv.headscores.lookup import cache_path, shipped_files
from criticalkv.headscores.needles import make_retrieval_sample
from criticalkv.methods import bind
from criticalkv.prompts import positions
from tests.conftest import make_tiny, padded_batch
from tests.helpers.random_state import one_thread
from tests.helpers.synthetic_scores import synthetic_head_scores

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_CACHE = os.environ.get("CRITICALKV_CACHE_DIR")  # where the default model lives (slow test)
SMOLLM2 = dict(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Score lookups and writes go to a fresh cache folder (never the user's)."""
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "cache"))
    with one_thread():
        yield


def word_tokenizer(vocab_size: int = 64) -> PreTrainedTokenizerFast:
    words = [*SPECIALS, *(f"w{i}" for i in range(vocab_size - len(SPECIALS)))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>", eos_token="<|im_end|>")


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_scores() -> HeadScores:
    """The real procedure on a tiny random model (every sample counted: it cannot retrieve)."""
    with one_thread():
        params = ScoringParameters(lengths=(96,), depths=2, min_accuracy=0.0)
        return compute_head_scores(tiny_llama(), word_tokenizer(), params, model_name="tiny", progress=False)


# --- scoring rules -------------------------------------------------------------------------------


def test_scoring_rules_on_hand_made_attention() -> None:
    """Three heads, two answer steps over 6 positions; the needle is positions 2..3 = tokens 7, 8."""
    tokens = torch.tensor([5, 6, 7, 8, 9, 9])
    answer = torch.tensor([7, 8])
    weights = torch.tensor(
        [
            [[0.1, 0.0, 0.6, 0.2, 0.08, 0.02], [0.0, 0.05, 0.15, 0.7, 0.06, 0.04]],  # copies both tokens
            [[0.5, 0.1, 0.0, 0.3, 0.08, 0.02], [0.0, 0.4, 0.35, 0.0, 0.0, 0.25]],  # looks elsewhere first
            [[0.0, 0.0, 0.2, 0.7, 0.06, 0.04], [0.0, 0.0, 0.1, 0.8, 0.06, 0.04]],  # on the needle, copies once
        ]
    )
    scores = head_scores_of(weights, tokens, answer, needle=(2, 4))
    assert scores[RETRIEVAL].tolist() == [1.0, 0.0, 0.5]
    # the needle's mass among each step's top-2 positions (k = the needle's length), step mean
    expected = torch.tensor([(0.8 + 0.85) / 2, (0.3 + 0.35) / 2, (0.9 + 0.9) / 2])
    assert torch.allclose(scores[RETRIEVAL_REASONING], expected)


def test_retrieval_sample_locates_needle_and_answer() -> None:
    tokenizer = word_tokenizer()
    sample = make_retrieval_sample(tokenizer, 200, depth=0.5, seed=3, chat=False)
    words = tokenizer.convert_ids_to_tokens(sample.input_ids)  # unknown words decode as the unk token
    assert len(sample.answer_ids) == 1 and len(sample.answer) == 7  # one whitespace word
    start, end = sample.needle
    assert end - start == len(f"One of the special magic numbers for {sample.key} is: {sample.answer}.".split())
    assert start < end <= sample.prompt_len < len(words)
    with pytest.raises(ValueError, match="depth"):
        make_retrieval_sample(tokenizer, 200, depth=1.5, seed=0)


# --- files ---------------------------------------------------------------------------------------


def test_file_round_trip_and_provenance(tiny_scores: HeadScores, tmp_path: Path) -> None:
    path = tiny_scores.save(tmp_path / "scores.json")
    loaded = load_head_scores(path)
    assert loaded.to_json() == json.loads(json.dumps(tiny_scores.to_json()))
    assert torch.equal(loaded.matrix(), tiny_scores.matrix())
    assert loaded.matrix().shape == (2, 2) and loaded.variants == [RETRIEVAL_REASONING, RETRIEVAL]
    data = json.loads(path.read_text())
    assert data["model"] == "tiny"
    assert data["architecture"] == {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_size": 32,
    }
    assert data["fingerprint"] == loaded.fingerprint
    assert data["procedure"]["parameters"]["lengths"] == [96]
    assert data["samples"]["total"] == data["samples"]["used"] == 2
    assert data["created"].endswith("Z") and "torch" in data["versions"]
    assert len(data["scores"][RETRIEVAL]["query_heads"][0]) == 4  # per query head too
    # a KV head's score is the mean over its GQA group's query heads
    query = torch.tensor(data["scores"][RETRIEVAL_REASONING]["query_heads"])
    assert torch.allclose(loaded.matrix(), query.view(2, 2, 2).mean(-1).double(), atol=1e-7)


def _edited(tiny_scores: HeadScores, tmp_path: Path, edit: Any) -> Path:
    data = copy.deepcopy(tiny_scores.to_json())
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["scores"][RETRIEVAL_REASONING]["kv_heads"][1].pop(), r"layer 1 has 1 heads, expected 2"),
        (lambda d: d["scores"][RETRIEVAL_REASONING]["kv_heads"].pop(), r"has 1 layers, expected 2"),
        (lambda d: d["scores"][RETRIEVAL_REASONING]["kv_heads"][0].__setitem__(1, float("nan")), "not a finite"),
        (lambda d: d["scores"][RETRIEVAL]["query_heads"][0].__setitem__(0, float("inf")), "not a finite"),
        (lambda d: d["scores"][RETRIEVAL_REASONING]["kv_heads"][0].__setitem__(0, -1.0), "negative"),
        (lambda d: d["scores"].__setitem__(RETRIEVAL_REASONING, {"kv_heads": [[0, 0], [0, 0]]}), "every .* is zero"),
        (lambda d: d.pop("format"), "not a criticalkv head-score file"),
        (lambda d: d.__setitem__("version", 99), "format version 99"),
        (lambda d: d["architecture"].pop("head_dim"), "lacks the model architecture"),
        (lambda d: d.__setitem__("default_variant", "copy"), "default_variant 'copy'"),
    ],
)
def test_bad_files_are_refused(tiny_scores: HeadScores, tmp_path: Path, edit: Any, message: str) -> None:
    path = _edited(tiny_scores, tmp_path, edit)
    with pytest.raises(ValueError, match=message) as info:
        load_head_scores(path)
    assert str(path) in str(info.value)


def test_unreadable_or_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"does not exist.*criticalkv head-scores"):
        load_head_scores(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="could not read head scores"):
        load_head_scores(tmp_path / "bad.json")


def test_scores_for_another_architecture_are_refused(tiny_scores: HeadScores, tmp_path: Path) -> None:
    path = tiny_scores.save(tmp_path / "tiny.json")
    other = make_tiny("qwen2")  # 3 layers, 6 heads: another architecture
    with pytest.raises(ValueError, match=r"computed for tiny \(llama, 2 layers.*this model is qwen2, 3 layers") as info:
        ckv.CompressedCache.for_model(other, "headkv", 0.3, head_scores=path)
    assert "criticalkv head-scores" in str(info.value)
    assert "model_type, num_hidden_layers, num_attention_heads, head_dim, hidden_size" in str(info.value)
    same_shape_other_type = LlamaConfig(**{**tiny_llama().config.to_dict(), "head_dim": 4, "hidden_size": 16})
    with pytest.raises(ValueError, match="differs in head_dim, hidden_size"):
        find_head_scores(same_shape_other_type, tiny_scores)


# --- finding and binding -------------------------------------------------------------------------


def test_no_scores_anywhere_says_how_to_compute_them() -> None:
    model = make_tiny("llama")
    with pytest.raises(ValueError, match=r"no head importance scores.*criticalkv head-scores --model MODEL --out"):
        ckv.CompressedCache.for_model(model, "critical-headkv", 0.3)
    ckv.CompressedCache.for_model(model, "snapkv", 0.3)  # other methods need none


@torch.no_grad()
def test_cached_scores_are_found_for_the_model() -> None:
    model = ckv.attach(make_tiny("llama"))
    scores = synthetic_head_scores(model, seed=3)
    scores.save(cache_path(model.config))
    cache = ckv.CompressedCache.for_model(model, "headkv", 0.3, window=5)
    assert cache.method.budgets.scores == scores.scores["synthetic"]  # type: ignore[attr-defined]
    ids, mask = padded_batch([50, 44], seed=1)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=cache)
    kept = cache.kept_entries()
    assert torch.equal(kept.sum((0, 2)), 3 * 2 * torch.tensor([15, 13]))  # L * H_kv * floor(0.3 n)
    with pytest.raises(ValueError, match="bound to the model before a cache exists"):  # the cache never looks up
        ckv.CompressedCache(3, "headkv", 0.3, window=5)
    plain = ckv.CompressedCache(3, ckv.bind(ckv.get_method("headkv"), model), 0.3, window=5)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=plain)
    assert torch.equal(plain.kept_entries(), kept)


@torch.no_grad()
def test_from_states_binds_the_states_model_and_matches_inflight() -> None:
    model = ckv.attach(make_tiny("mistral"))
    scores = synthetic_head_scores(model, seed=5)
    ids, mask = padded_batch([50, 44], seed=2)
    capture = ckv.CaptureCache(3, window=5)
    model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=capture)
    for method in ("headkv", "critical-headkv"):
        inflight = ckv.CompressedCache.for_model(model, method, 0.3, window=5, head_scores=scores)
        model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), cache=inflight)
        derived = ckv.CompressedCache.from_states(capture.states(), method, 0.3, head_scores=scores)
        for a, b in zip(inflight.keep_masks(), derived.keep_masks(), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="no head importance scores"):  # the states' model has none cached
        ckv.CompressedCache.from_states(capture.states(), "headkv", 0.3)
    wrong = HeadScores.from_matrix(torch.ones(3, 2), make_tiny("llama").config)  # same shape, llama
    with pytest.raises(ValueError, match="differs in model_type"):
        ckv.CompressedCache.from_states(capture.states(), "headkv", 0.3, head_scores=wrong)


def test_bind_leaves_other_methods_alone(tiny_scores: HeadScores) -> None:
    snapkv = ckv.get_method("snapkv")
    assert bind(snapkv, tiny_llama(), tiny_scores) is snapkv
    bound = bind(ckv.get_method("headkv"), tiny_llama(), tiny_scores)
    assert bound.budgets.scores == tiny_scores.scores[RETRIEVAL_REASONING]  # type: ignore[attr-defined]
    assert bind(bound, tiny_llama()) is bound  # already bound
    with pytest.raises(ValueError, match="no model to look them up"):
        bind(ckv.get_method("headkv"))


def test_the_shipped_default_model_scores() -> None:
    files = shipped_files()
    assert [p.name for p in files] == ["SmolLM2-135M-Instruct.json"]
    config = LlamaConfig(vocab_size=64, intermediate_size=64, **SMOLLM2)  # the default model's architecture
    found = find_head_scores(config)
    assert found.model == "SmolLM2-135M-Instruct"
    assert found.fingerprint == load_head_scores(files[0]).fingerprint
    assert found.default_variant == RETRIEVAL_REASONING and found.matrix().shape == (30, 3)
    assert found.samples["used"] >= 10 and found.procedure["parameters"]["min_accuracy"] == 1.0
    assert architecture(config) == dict(found.architecture)


# --- the command ---------------------------------------------------------------------------------


def test_head_scores_command_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "tiny-model"
    tiny_llama().save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    out = tmp_path / "out" / "scores.json"
    args = ["head-scores", "--model", str(folder), "--out", str(out), "--lengths", "80,96", "--depths", "2"]
    assert main([*args, "--min-accuracy", "0"]) == 0
    printed = capsys.readouterr().out
    assert "4 of 4 samples used" in printed and "top KV heads" in printed
    scores = load_head_scores(out)
    assert scores.model == "tiny-model" and scores.samples["total"] == 4
    assert [r["length"] for r in scores.samples["runs"]] == [80, 80, 96, 96]
    model, _ = ckv.load_model(folder)
    cached = cache_path(model.config)
    assert cached.is_file() and load_head_scores(cached).to_json() == scores.to_json()
    assert ckv.CompressedCache.for_model(model, "headkv", 0.3).method.budgets.scores is not None  # type: ignore[attr-defined]
    # a random model never produces the needle: with the default min accuracy nothing counts
    assert main([*args, "--no-cache"]) == 2
    assert "produced the needle in none of the 4 samples" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [(["--lengths", "abc"], "token counts"), (["--depths", "0"], "depths must be"), (["--lengths", "10"], "64")],
)
def test_head_scores_command_rejects_bad_arguments(
    extra: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["head-scores", "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "s.json"), *extra])
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@torch.no_grad()
def test_default_model_compresses_with_the_shipped_scores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if USER_CACHE is None:
        monkeypatch.delenv("CRITICALKV_CACHE_DIR")
    else:
        monkeypatch.setenv("CRITICALKV_CACHE_DIR", USER_CACHE)
    model, tokenizer = ckv.load_model("default")
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "empty-cache"))  # no user scores: the shipped ones
    shipped = load_head_scores(shipped_files()[0])
    sample = make_retrieval_sample(tokenizer, 1024, depth=0.5, seed=11)
    ids = torch.tensor([sample.input_ids[: sample.prompt_len]])
    for method in ("headkv", "critical-headkv"):
        cache = ckv.CompressedCache.for_model(ckv.attach(model), method, 0.2, window=16)
        assert cache.method.budgets.scores == shipped.scores[shipped.default_variant]  # type: ignore[attr-defined]
        model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, logits_to_keep=1)
        kept = cache.kept_entries()[:, 0]  # (L, H_kv)
        assert int(kept.sum()) == 30 * 3 * int(0.2 * ids.shape[1])
        assert int(kept.min()) >= 16 and int(kept.max()) > 2 * int(kept.min())  # budgets follow the heads
