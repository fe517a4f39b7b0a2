"""Perturbation analysis: the math on random tensors, the tiny models, and the command end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

import criticalkv as ckv
from criticalkv.analysis import (
    RunSpec,
    attention_weights,
    head_outputs,
    hidden_state_drift,
    kept_mass,
    measure_sample,
    output_perturbation,
    perturbation_bound,
    recording_queries,
)
from criticalkv.analysis import experiment as runner_module
from criticalkv.analysis.experiment import Config, check_budgets, comparison_configs, critical_variant
from criticalkv.analysis.results_log import ResultsLog
from criticalkv.cli import main
from criticalkv.prompts import positions
from tests.conftest import ARCHS, VOCAB, make_tiny, padded_batch

# --- references ----------------------------------------------------------------------------------


def _naive(
    weights: torch.Tensor, keep: torch.Tensor, values: torch.Tensor, o_proj_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L, sigma and theta by the textbook formulas, in float64, one head and config at a time."""
    b, h_q, q, _ = weights.shape
    c, _, h_kv, _ = keep.shape
    g, d = h_q // h_kv, values.shape[-1]
    l1 = torch.zeros(c, b, h_q, q, dtype=torch.float64)
    sigma, theta = torch.zeros_like(l1), torch.zeros_like(l1)
    for h in range(h_q):
        w_o = o_proj_weight[:, h * d : (h + 1) * d].T.double()  # (d, D)
        for row in range(b):
            p = values[row, h // g].double() @ w_o  # (T, D)
            n = p.abs().sum(-1)
            a = weights[row, h].double()  # (Q, T)
            o = a @ p
            for k in range(c):
                kept = keep[k, row, h // g].double()
                s = (a * kept).sum(-1)  # (Q,)
                o_hat = ((a * kept) @ p) / s[:, None]
                l1[k, row, h] = (o - o_hat).abs().sum(-1)
                sigma[k, row, h] = s
                total = (a * n).sum(-1)
                theta[k, row, h] = total - (2 - 1 / s) * (a * kept * n).sum(-1)
    return l1, sigma, theta


def _random_case(
    seed: int, b: int, h_kv: int, g: int, t: int, q: int, d: int, hidden: int, c: int, keep_share: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(b, h_kv * g, q, t, generator=gen)
    weights = torch.softmax(logits, dim=-1)
    keep = torch.rand(c, b, h_kv, t, generator=gen) < keep_share
    keep[..., -1] = True  # every query sees the last key
    values = torch.randn(b, h_kv, t, d, generator=gen)
    o_proj_weight = torch.randn(hidden, h_kv * g * d, generator=gen)
    return weights, keep, values, o_proj_weight


# --- the math on random tensors ------------------------------------------------------------------


@settings(deadline=None, derandomize=True, max_examples=40)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 2),
    h_kv=st.integers(1, 2),
    g=st.integers(1, 3),
    t=st.integers(2, 24),
    q=st.integers(1, 4),
    d=st.sampled_from([2, 4]),
    hidden=st.sampled_from([3, 8]),
    c=st.integers(1, 3),
    keep_share=st.floats(0.05, 1.0),
    chunk=st.sampled_from([64, 1 << 25]),
)
def test_perturbation_matches_the_formulas_and_obeys_the_bound(
    seed: int, b: int, h_kv: int, g: int, t: int, q: int, d: int, hidden: int, c: int, keep_share: float, chunk: int
) -> None:
    weights, keep, values, w_o = _random_case(seed, b, h_kv, g, t, q, d, hidden, c, keep_share)
    res = output_perturbation(weights, keep, values, w_o, max_chunk_bytes=chunk)
    l1, sigma, theta = _naive(weights, keep, values, w_o)
    torch.testing.assert_close(res.l1.double(), l1, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(res.sigma, sigma, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(res.theta, theta, rtol=1e-5, atol=1e-5)
    above = res.sigma > 0.5
    assert bool((res.l1.double()[above] <= res.theta[above] * (1 + 1e-4) + 1e-6).all())
    # the triangle inequality behind the bound needs only sigma > 0
    assert bool((res.l1.double() <= res.theta * (1 + 1e-4) + 1e-6).all())


def test_full_keep_mask_gives_zero_perturbation_and_bound() -> None:
    weights, keep, values, w_o = _random_case(3, 2, 2, 3, 30, 4, 4, 8, 2, 0.5)
    res = output_perturbation(weights, torch.ones_like(keep), values, w_o)
    assert float(res.l1.abs().max()) < 1e-5
    assert float(res.theta.abs().max()) < 1e-6
    torch.testing.assert_close(res.sigma, torch.ones_like(res.sigma), rtol=0, atol=1e-6)


def test_bound_terms_match_the_paper_form() -> None:
    weights, keep, values, w_o = _random_case(5, 1, 2, 2, 20, 3, 4, 8, 3, 0.6)
    norms = output_perturbation(weights, keep, values, w_o).norms
    bound = perturbation_bound(weights, keep, norms)
    sigma, evicted = kept_mass(weights, keep)
    torch.testing.assert_close(sigma + evicted, torch.ones_like(sigma), rtol=0, atol=1e-6)
    # equal up to the float32 softmax summing to 1 (the code uses the evicted mass, not 1 - sigma)
    torch.testing.assert_close(bound.theta, bound.total - (2 - 1 / bound.sigma) * bound.kept, rtol=1e-5, atol=1e-5)


def test_shape_errors_say_what_is_expected() -> None:
    weights, keep, values, w_o = _random_case(0, 1, 2, 2, 10, 2, 4, 8, 1, 0.5)
    with pytest.raises(ValueError, match=r"\(C, B, H_kv, T\)"):
        output_perturbation(weights, keep[0], values, w_o)
    with pytest.raises(ValueError, match="multiple of"):
        output_perturbation(weights, keep, values, w_o[:, :-1])
    with pytest.raises(ValueError, match="keeps no entry"):
        output_perturbation(weights, torch.zeros_like(keep), values, w_o)
    with pytest.raises(ValueError, match="query_positions"):
        attention_weights(torch.randn(1, 4, 2, 4), torch.randn(1, 2, 10, 4), 0.5, torch.arange(3))
    with pytest.raises(ValueError, match="same shape"):
        hidden_state_drift(torch.zeros(1, 2, 3), torch.zeros(1, 3, 3))


def test_hidden_state_drift() -> None:
    h = torch.randn(1, 4, 16)
    same = hidden_state_drift(h, h.clone())
    assert same.means() == {"hidden_l1": 0.0, "hidden_l1_relative": 0.0, "hidden_cosine": pytest.approx(1.0)}
    moved = hidden_state_drift(h, -h)
    assert moved.means()["hidden_cosine"] == pytest.approx(-1.0)
    assert moved.means()["hidden_l1_relative"] == pytest.approx(2.0)


# --- the tiny models -----------------------------------------------------------------------------


def _tiny_with_bias() -> PreTrainedModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.normal_()
    return model


@pytest.mark.parametrize("arch", [*ARCHS, "llama-bias"])
@torch.no_grad()
def test_head_outputs_sum_to_the_attention_module_output(arch: str) -> None:
    model = _tiny_with_bias() if arch == "llama-bias" else make_tiny(arch)
    window = 7
    ids, mask = padded_batch([40, 33], seed=4)
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        states, _ = ckv.prefill(model, ids, mask, window=window)
    finally:
        for hook in hooks:
            hook.remove()
    t = ids.shape[1]
    for i, state in enumerate(states):
        weights = attention_weights(
            state.queries[:, :, -window:], state.keys, state.scaling, torch.arange(t - window, t), state.valid
        )
        o_proj = state.module.o_proj
        per_head = head_outputs(weights, state.values, o_proj.weight)  # (B, H_q, w, D)
        total = per_head.sum(1)
        if o_proj.bias is not None:
            total = total + o_proj.bias
        torch.testing.assert_close(total, outputs[i][:, -window:].float(), rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_recorded_decode_queries_are_the_models_queries() -> None:
    """Queries recorded while decoding answer tokens equal those of a prefill of prompt + answer."""
    model = make_tiny("llama")
    ids, mask = padded_batch([30], seed=5)
    answer = torch.randint(3, VOCAB, (1, 4), generator=torch.Generator().manual_seed(6))
    states, _ = ckv.prefill(model, ids, mask, window=4)
    cache = ckv.CompressedCache.from_states(states, "full", 1.0)
    full_mask = torch.cat([mask, torch.ones_like(answer)], 1)
    with recording_queries(model) as record:
        model(input_ids=answer, attention_mask=full_mask, position_ids=positions(full_mask)[:, -4:], cache=cache)
    assert model.config._attn_implementation == ckv.cache.ATTN_IMPLEMENTATION  # restored
    joint, _ = ckv.prefill(model, torch.cat([ids, answer], 1), full_mask, window=4)
    for layer, state in enumerate(joint):
        torch.testing.assert_close(record.layer(layer), state.queries[:, :, -4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_bound_holds_on_the_tiny_models(arch: str) -> None:
    model = make_tiny(arch)
    window = 6
    ids, mask = padded_batch([64], seed=7)
    states, _ = ckv.prefill(model, ids, mask, window=window)
    t = ids.shape[1]
    configs = [("snapkv", 0.2), ("critical-snapkv", 0.2), ("adakv", 0.6), ("critical-adakv", 0.6), ("full", 1.0)]
    caches = [ckv.CompressedCache.from_states(states, m, b) for m, b in configs]
    for layer, state in enumerate(states):
        keep = torch.stack([cache.keep_masks()[layer] for cache in caches])
        weights = attention_weights(state.queries, state.keys, state.scaling, torch.arange(t - window, t), state.valid)
        res = output_perturbation(weights, keep, state.values, state.module.o_proj.weight)
        above = res.sigma > 0.5
        assert bool(above[2:4].any())  # (random models attend almost uniformly: sigma ~ the budget)
        assert bool((res.l1.double()[above] <= res.theta[above] * (1 + 1e-4) + 1e-6).all())
        assert bool((res.l1.double() <= res.theta * (1 + 1e-4) + 1e-6).all())  # holds for any sigma
        assert float(res.l1[-1].abs().max()) < 1e-5  # full cache


@torch.no_grad()
def test_sharing_scores_and_norms_across_configs_changes_no_selection() -> None:
    model = make_tiny("mistral")
    ids, mask = padded_batch([50], seed=8)
    states, _ = ckv.prefill(model, ids, mask, window=5)
    for name in ("snapkv", "critical-snapkv", "adakv", "critical-adakv", "full"):
        for budget in (0.2, 0.5):
            shared = ckv.CompressedCache.from_states(states, name, budget).keep_masks()
            fresh_states, _ = ckv.prefill(model, ids, mask, window=5)
            plain = ckv.CompressedCache.from_states(fresh_states, name, budget).keep_masks()
            assert all(torch.equal(a, b) for a, b in zip(shared, plain, strict=True)), (name, budget)
    assert all(len(state.memo) == 2 for state in states)  # one score and one norm tensor per layer


# --- the runner ----------------------------------------------------------------------------------


def _tokenizer() -> PreTrainedTokenizerFast:
    """Word-level, digits one token each (like SmolLM2), everything unknown mapped to id 0."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    words = [*specials, *"0123456789", "The", "is", "special", "magic", "number", "What"]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)]
    )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )


SPEC = RunSpec(model="tiny", length=120, window=8)


@pytest.fixture(scope="module")
def tiny_rows() -> list[dict[str, Any]]:
    model = ckv.attach(make_tiny("llama"))
    configs = [*comparison_configs(["snapkv", "adakv"], [0.2]), Config("full", 1.0), Config("snapkv", 1.0)]
    return measure_sample(model, _tokenizer(), 0, SPEC, configs)


def test_rows_have_per_head_measures(tiny_rows: list[dict[str, Any]]) -> None:
    assert [r["method"] for r in tiny_rows] == [
        "snapkv",
        "critical-snapkv",
        "adakv",
        "critical-adakv",
        "full",
        "snapkv",
    ]
    for row in tiny_rows:
        assert np.asarray(row["perturbation_window"]).shape == (3, 6)
        assert np.asarray(row["kept"]).shape == (3, 2)
        assert row["answer_tokens"] == 7  # a 7-digit needle, one token per digit
        assert row["bound_violations"] == 0
        assert row["queries"] == SPEC.window + 7
        json.dumps(row)  # JSON-ready


def test_full_cache_rows_show_no_perturbation(tiny_rows: list[dict[str, Any]]) -> None:
    for row in tiny_rows[-2:]:  # full, and snapkv at budget 1.0
        for name in ("perturbation_window", "perturbation_decode"):
            assert float(np.abs(row[name]).max()) < 1e-5
        assert row["hidden_l1_relative"] < 1e-5
        assert row["hidden_cosine"] == pytest.approx(1.0, abs=1e-6)
        assert float(np.min(row["sigma_window"])) == pytest.approx(1.0, abs=1e-6)


def test_compression_perturbs_and_keeps_the_budgets(tiny_rows: list[dict[str, Any]]) -> None:
    by = {r["method"]: r for r in tiny_rows[:4]}
    for row in by.values():
        assert float(np.mean(row["perturbation_decode"])) > 0
        assert row["hidden_l1"] > 0
        assert int(np.sum(row["kept"])) == 3 * 2 * row["budget_tokens"]  # H_kv * b per layer
    assert by["critical-adakv"]["kept"] == by["adakv"]["kept"]  # AdaKV's per-head budgets
    assert by["critical-snapkv"]["kept"] == by["snapkv"]["kept"]
    assert by["adakv"]["kept"] != by["snapkv"]["kept"]  # AdaKV does vary them


def test_configs_and_budget_checks() -> None:
    assert critical_variant("adakv") == "critical-adakv"
    with pytest.raises(ValueError, match="pass its base method"):
        critical_variant("critical-snapkv")
    with pytest.raises(ValueError, match="keeps every entry"):
        critical_variant("full")
    with pytest.raises(ValueError, match="unknown method"):
        critical_variant("nope")
    with pytest.raises(ValueError, match=r"20 tokens, below the observation window \(32"):
        check_budgets([0.01], 2048, 32)
    with pytest.raises(ValueError, match="budget 16 tokens is, below"):
        check_budgets([16], 2048, 32)
    check_budgets([0.025, 64], 2048, 32)
    with pytest.raises(ValueError, match="window"):
        RunSpec(model="x", length=64, window=0)


def test_results_log_drops_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    ResultsLog(path).append([{"sample": 0, "method": "a", "budget": 0.1}])
    with path.open("a") as fh:
        fh.write('{"sample": 1, "meth')  # a crash mid-write
    log = ResultsLog(path)
    assert log.done() == {(0, "a", "0.1")}
    log.append([{"sample": 1, "method": "a", "budget": 0.1}])
    assert log.done() == {(0, "a", "0.1"), (1, "a", "0.1")}
    assert len(path.read_text().splitlines()) == 2


# --- the command ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    make_tiny("llama").save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def _cli(folder: Path, out: Path, *extra: str) -> list[str]:
    return [
        "perturbation",
        "--model",
        str(folder),
        "--methods",
        "snapkv,adakv",
        "--budgets",
        "0.2,0.4",
        "--length",
        "120",
        "--window",
        "8",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


def test_command_end_to_end_and_resume(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    assert main(_cli(model_folder, out, "--samples", "2")) == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 * 2 * 2 * 2  # samples x bases x (base, critical) x budgets
    for name in ("heads.csv", "summary.md", "curves.png", "heatmap-window.png", "heatmap-decode.png", "config.json"):
        assert (out / name).is_file(), name
    heads = (out / "heads.csv").read_text().splitlines()
    assert len(heads) == 1 + 3 * 6 * 8  # header + layers x heads x (method, budget)
    assert "reduction_decode" in heads[0]
    summary = (out / "summary.md").read_text()
    assert "criticalkv perturbation --model" in summary
    assert "equal its base's on every sample: yes" in summary
    assert "| snapkv | 0.2 | decode |" in summary
    assert "heads lowered" in capsys.readouterr().out

    calls: list[int] = []
    real = runner_module.measure_sample

    def counting(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        calls.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "measure_sample", counting)
    assert main(_cli(model_folder, out, "--samples", "3")) == 0  # one more sample: only it is measured
    assert calls == [2]
    assert len((out / "results.jsonl").read_text().splitlines()) == 24
    assert main(_cli(model_folder, out, "--samples", "3")) == 0  # all done: nothing is measured
    assert calls == [2]
    assert "0 rows measured, 24 already done" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert len(config["commands"]) == 3
    assert config["provenance"]["torch"] == torch.__version__

    (out / "heads.csv").unlink()
    assert main([*_cli(model_folder, out), "--report-only"]) == 0
    assert (out / "heads.csv").is_file()


def test_command_refuses_other_settings_in_the_same_folder(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main(_cli(model_folder, out, "--samples", "1", "--budgets", "0.4")) == 0
    capsys.readouterr()
    assert main(_cli(model_folder, out, "--samples", "1", "--window", "6")) == 2
    assert "other settings (window: 8 there, 6 now)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budgets", "0.01"], "below the observation window"),
        (["--window", "64", "--budgets", "0.4"], "below the observation window (64"),
    ],
)
def test_command_bad_budgets(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    argv = _cli(model_folder, tmp_path / "run")
    for flag, value in zip(args[::2], args[1::2], strict=True):
        argv[argv.index(flag) + 1] = value
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before loading the model or writing anything


@pytest.mark.parametrize(("methods", "message"), [("critical-adakv", "pass its base method"), ("full", "keeps every")])
def test_command_bad_methods(
    model_folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], methods: str, message: str
) -> None:
    argv = _cli(model_folder, tmp_path / "run")
    argv[argv.index("--methods") + 1] = methods
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_command_on_the_default_model(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["perturbation", "--model", "default", "--budgets", "0.1", "--samples", "1", "--length", "1024"]
    assert main([*argv, "--out", str(out), "--no-progress"]) == 0
    rows = ResultsLog(out / "results.jsonl").rows()
    assert [r["method"] for r in rows] == ["snapkv", "critical-snapkv", "adakv", "critical-adakv"]
    for row in rows:
        assert np.asarray(row["perturbation_decode"]).shape == (30, 9)
        assert row["bound_violations"] == 0
    assert rows[3]["kept"] == rows[2]["kept"]
    assert "heads lowered" in (out / "summary.md").read_text()


def test_a_perturbation_folder_has_one_writer(tmp_path: Path) -> None:
    from criticalkv.analysis.experiment import RunSpec, run_perturbation
    from criticalkv.runs import FolderBusy, writer_lock

    out = tmp_path / "perturbation"
    with writer_lock(out), pytest.raises(FolderBusy, match=f"is writing to {out}"):
        run_perturbation(None, None, RunSpec(model="tiny", length=2048, window=8), out, samples=1, wait=0)
    assert not (out / "config.json").exists()  # refused before anything was written
