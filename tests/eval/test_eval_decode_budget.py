"""``criticalkv eval`` under a decode budget: each row's own cache, stepwise teacher forcing, records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import criticalkv as ckv
from criticalkv.cache.batch import decode_budget_cache
from criticalkv.cli import main
from criticalkv.eval import results as sweep_results
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.runtime import append_tokens, prefill, prefill_into, teacher_forced_logprobs
from tests.conftest import make_tiny, padded_batch
from tests.helpers.tiny_tokenizer import char_tokenizer

WINDOW = 6


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return ckv.attach(make_tiny("llama"))


def _greedy(model: torch.nn.Module, cache: ckv.CompressedCache, mask: torch.Tensor, first: int, n: int):  # type: ignore[no-untyped-def]
    """``n`` greedy steps from ``first``: the tokens fed and the (n, V) log-probs after each."""
    token, fed, logprobs = torch.tensor([[first]]), [], []
    for _ in range(n):
        out, mask = append_tokens(model, cache, mask, token)
        fed.append(int(token))
        logprobs.append(torch.log_softmax(out.logits[0, -1].float(), -1))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    return fed, torch.stack(logprobs)


@pytest.mark.parametrize("method", ["snapkv", "critical-adakv"])
def test_decode_budget_cache_from_states_decodes_like_a_cache_that_prefilled(tiny, method: str) -> None:  # type: ignore[no-untyped-def]
    """The eval path (compress captured states, then hold a decode budget) equals the cache that compressed itself."""
    ids, mask = padded_batch([70], seed=3)
    states, _ = prefill(tiny, ids, mask, window=WINDOW)
    bound = ckv.methods.bind(ckv.get_method(method), tiny)
    from_states, _ = decode_budget_cache(states, ckv.CacheSpec(bound, 30, WINDOW, ckv.DecodeBudget(16, 5)))
    own = ckv.CompressedCache.for_model(tiny, method, 30, window=WINDOW, decode_budget=16, decode_interval=5)
    prefill_into(tiny, own, ids, mask)
    assert from_states.kv_bytes() == own.kv_bytes()
    _, a = _greedy(tiny, from_states, mask, 5, 24)
    _, b = _greedy(tiny, own, mask, 5, 24)
    assert torch.allclose(a, b, atol=1e-5)
    assert from_states.decode is not None and own.decode is not None
    assert from_states.decode.reselections == own.decode.reselections > 0


def test_stepwise_teacher_forcing_sees_what_generation_sees(tiny) -> None:  # type: ignore[no-untyped-def]
    """Teacher-forcing a held cache's own greedy continuation reproduces generation's log-probs; the
    one-forward teacher forcing does not (the decode budget would not apply within the answer)."""
    ids, mask = padded_batch([70], seed=4)
    states, last = prefill(tiny, ids, mask, window=WINDOW)
    spec = ckv.CacheSpec.of("snapkv", 30, WINDOW, decode_budget=12, decode_interval=3)
    gen_cache, _ = decode_budget_cache(states, spec)
    first = int(last.argmax(-1))
    fed, gen = _greedy(tiny, gen_cache, mask, first, 20)
    answer = [first, *fed[1:]]
    scored = {}
    for stepwise in (True, False):
        cache, _ = decode_budget_cache(states, spec)
        n = len(answer)
        scored[stepwise] = teacher_forced_logprobs(tiny, cache, mask, answer, n, last, one_token_steps=stepwise)
    # position i of teacher forcing predicts answer[i]; generation's step i predicts the token after fed[i]
    assert torch.allclose(scored[True][0, 1:], gen[:-1], atol=1e-5)
    assert not torch.allclose(scored[False][0, 1:], gen[:-1], atol=1e-3)


def test_stepwise_equals_one_forward_without_a_decode_budget(tiny) -> None:  # type: ignore[no-untyped-def]
    ids, mask = padded_batch([50], seed=6)
    states, _ = prefill(tiny, ids, mask, window=WINDOW)
    suffix, answer_len = [3, 4, 5, 6, 7, 8, 9], 4  # question (3 tokens), then the answer
    out = {}
    for stepwise in (True, False):
        cache = ckv.CompressedCache.from_states(states, "adakv", 20)
        out[stepwise] = teacher_forced_logprobs(tiny, cache, mask, suffix, answer_len, None, one_token_steps=stepwise)
    assert out[True].shape == out[False].shape == (1, answer_len, tiny.config.vocab_size)
    assert torch.allclose(out[True], out[False], atol=1e-5)


def _config(out: Path, **kw: object) -> SweepConfig:
    base: dict[str, object] = dict(
        out=out,
        tasks=["niah_single_1"],
        lengths=[400],
        methods=["full", "snapkv", "critical-adakv", "layer-defensivekv"],
        budgets=[0.3],
        samples=1,
        window=WINDOW,
        max_new_tokens=12,
        model="tiny",
    )
    base.update(kw)
    return SweepConfig(**base)  # type: ignore[arg-type]


def test_sweep_under_a_decode_budget_records_the_peak_and_keys_the_identity(tmp_path: Path, tiny) -> None:  # type: ignore[no-untyped-def]
    plain = _config(tmp_path / "plain")
    held = _config(tmp_path / "held", decode_budget=10, decode_interval=4)
    assert "decode_budget" not in plain.identity() and "decode_budget" not in plain.to_json()
    assert held.identity()["decode_budget"] == 10 and held.identity()["decode_interval"] == 4
    assert _config(tmp_path / "x", decode_budget=10).cache["decode_interval"] == 64  # the default interval
    run_sweep(held, tiny, char_tokenizer())
    records = {r["method"]: r for r in sweep_results.read_results(held.out)}
    assert set(records) == {"full", "snapkv", "critical-adakv", "layer-defensivekv"}
    layer = tiny.model.layers[0].self_attn
    heads, dim, layers = tiny.config.num_key_value_heads, layer.head_dim, tiny.config.num_hidden_layers
    entry = 2 * dim * 4 * heads * layers  # float32 keys and values of one position in every head and layer
    for name in ("snapkv", "critical-adakv", "layer-defensivekv"):  # the last: each layer at its joint share
        r = records[name]
        assert (r["decode_budget"], r["decode_interval"], r["batch_rows"]) == (10, 4, 1)
        # the prompt is compressed to at most the decode budget and the tail sized to the interval:
        # memory held is memory needed, at most (budget + interval + 1) entries per head at any step
        assert r["kv_bytes"] <= 10 * entry
        assert r["kv_bytes"] < r["kv_bytes_peak"] <= (10 + 4 + 1) * entry
        assert r["kv_bytes_peak"] < records["full"]["kv_bytes_peak"]
    assert records["full"]["kl"] == pytest.approx(0.0, abs=1e-6) and records["full"]["top1"] == 1.0
    assert records["full"]["kv_bytes_peak"] >= records["full"]["kv_bytes"]


def test_sweep_config_refuses_bad_decode_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="below the observation window"):
        _config(tmp_path / "a", decode_budget=WINDOW - 1)
    with pytest.raises(ValueError, match="re-selects under a decode budget"):
        _config(tmp_path / "b", decode_interval=8)
    with pytest.raises(ValueError, match="cannot re-select while decoding"):
        _config(tmp_path / "c", methods=["full", "h2o"], decode_budget=16)
    with pytest.raises(ValueError, match="positive"):
        _config(tmp_path / "d", decode_budget=16, decode_interval=0)


def test_eval_command_with_a_decode_budget(
    tiny_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    common = ["eval", "--model", str(tiny_folder), "--tasks", "niah_single_1", "--lengths", "400", "--samples", "1"]
    common += ["--methods", "full,snapkv,layer-defensivekv", "--budgets", "0.3", "--window", str(WINDOW)]
    common += ["--max-new-tokens", "8"]
    assert main([*common, "--decode-budget", "2", "--out", str(out)]) == 2
    assert "--decode-budget 2 is below the observation window" in capsys.readouterr().err
    assert not out.exists()
    assert main([*common, "--decode-budget", "12", "--decode-interval", "4", "--out", str(out)]) == 0
    identity = json.loads((out / "run.json").read_text())["identity"]
    assert (identity["decode_budget"], identity["decode_interval"]) == (12, 4)
    records = sweep_results.read_results(out)
    assert {r["method"] for r in records} == {"full", "snapkv", "layer-defensivekv"}
    assert all(r["decode_budget"] == 12 and r["kv_bytes_peak"] > 0 for r in records)
    # another decode budget is another run: refused before the model loads
    assert main([*common, "--decode-budget", "16", "--decode-interval", "4", "--out", str(out)]) == 2
    assert "decode_budget: 12 there, 16 now" in capsys.readouterr().err
