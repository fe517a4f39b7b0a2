"""KVzip (Kim et al. 2025, arXiv 2505.23416): the reconstruction pass against a plain eager forward,
batch rows against each row alone, the score's definition, the joint budgets, generation end to end,
and the refusals where the pass cannot run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import criticalkv as ckv
from criticalkv.bench.kvpress_impl import import_kvpress
from criticalkv.budgets import LayerJoint
from criticalkv.eval import results as sweep_results
from criticalkv.eval.sweep import SweepConfig, run_sweep
from criticalkv.runtime import RepeatPrompt, prefill, repeat_prompt
from criticalkv.runtime.reconstruction import CUE_TOKENS
from criticalkv.scores.kvzip import ReconstructionAttention
from tests.conftest import make_tiny, padded_batch
from tests.helpers.random_state import random_state, with_reconstruction
from tests.helpers.tiny_tokenizer import char_tokenizer

PROMPT = (5, 6, 7)


def eager_reference(arch: str, context: list[int], prompt: RepeatPrompt) -> list[torch.Tensor]:
    """Per layer, (H_q, T): the most attention each context token gets from any token of any pass,
    each pass a plain eager forward of ``context + prompt + cue + chunk`` returning its attentions."""
    model = make_tiny(arch)
    model.set_attn_implementation("eager")
    t, best = len(context), None
    for start in range(0, t, prompt.chunk):
        piece = list(prompt.ids) + context[max(0, start - CUE_TOKENS) : start] + context[start : start + prompt.chunk]
        with torch.no_grad():
            out = model(input_ids=torch.tensor([context + piece]), output_attentions=True)
        seen = [a[0, :, t:, :t].amax(dim=1).double() for a in out.attentions]
        best = seen if best is None else [torch.maximum(x, y) for x, y in zip(best, seen, strict=True)]
    assert best is not None
    return best


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("chunk", [64, 11])  # one pass; three passes with a cue
def test_reconstruction_is_the_attention_of_a_plain_forward(arch: str, chunk: int) -> None:
    ids, mask = padded_batch([30], seed=3)
    prompt = RepeatPrompt(PROMPT, chunk=chunk)
    states, _ = prefill(ckv.attach(make_tiny(arch)), ids, mask, window=4, reconstruction=prompt)
    reference = eager_reference(arch, ids[0].tolist(), prompt)
    for state, expected in zip(states, reference, strict=True):
        assert state.reconstruction is not None
        torch.testing.assert_close(state.reconstruction[0].double(), expected, atol=1e-5, rtol=1e-4)


def test_padded_rows_get_what_each_row_gets_alone() -> None:
    model = ckv.attach(make_tiny("mistral"))
    ids, mask = padded_batch([33, 21], seed=4)
    prompt = RepeatPrompt(PROMPT, chunk=13)
    together, _ = prefill(model, ids, mask, window=4, reconstruction=prompt)
    for row in range(2):
        real = mask[row].bool()
        alone, _ = prefill(model, ids[row : row + 1, real], mask[row : row + 1, real], window=4, reconstruction=prompt)
        for a, b in zip(together, alone, strict=True):
            assert a.reconstruction is not None and b.reconstruction is not None
            torch.testing.assert_close(a.reconstruction[row][:, real], b.reconstruction[0], atol=1e-4, rtol=1e-3)
            assert float(a.reconstruction[row][:, ~real].abs().sum()) == 0.0  # padding gets nothing


def test_the_score_is_the_group_maximum_with_sinks_first() -> None:
    state = with_reconstruction(random_state(0, lengths=[20, 14], num_kv_heads=2, group=3, head_dim=8, window=3))
    assert state.reconstruction is not None
    scores = ReconstructionAttention(sinks=4)(state)
    expected = state.reconstruction.view(2, 2, 3, 20).amax(dim=2)
    first = [20 - 20, 20 - 14]  # the first real column of each row
    for row, start in enumerate(first):
        torch.testing.assert_close(scores[row, :, start + 4 :], expected[row, :, start + 4 :])
        assert bool((scores[row, :, start : start + 4] == 1.0).all())
    assert float(expected.max()) <= 1.0  # attention weights: the sinks' 1 is the top score
    with pytest.raises(ValueError, match="sinks must be a non-negative integer"):
        ReconstructionAttention(sinks=-1)


def test_kvzip_selects_over_all_layers_and_critical_kvzip_reweighs_within_its_budgets() -> None:
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([40, 31], seed=5)
    states, _ = prefill(model, ids, mask, window=4, reconstruction=RepeatPrompt(PROMPT))
    kvzip = ckv.CompressedCache.from_states(states, "kvzip", 0.3, window=4)
    critical = ckv.CompressedCache.from_states(states, "critical-kvzip", 0.3, window=4)
    assert isinstance(ckv.get_method("kvzip").budgets, LayerJoint)
    kept = kvzip.kept_entries()  # (L, B, H_kv)
    per_row = torch.tensor([int(0.3 * 40), int(0.3 * 31)])
    assert torch.equal(kept.sum((0, 2)), 3 * 2 * per_row)  # the uniform total, spread over layers and heads
    assert bool((kept >= 4).all())
    assert torch.equal(critical.kept_entries(), kept)  # the same budgets; the second stage reweighs by ||V W_O||


def test_the_uniform_variant_is_a_composition() -> None:
    uniform = ckv.Method("kvzip-uniform", "KVzip, per-head top-k", "-", ReconstructionAttention())
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([40], seed=6)
    states, _ = prefill(model, ids, mask, window=4, reconstruction=RepeatPrompt(PROMPT))
    cache = ckv.CompressedCache.from_states(states, uniform, 0.3, window=4)
    assert bool((cache.kept_entries() == int(0.3 * 40)).all())


@pytest.mark.parametrize("mode", ["question-agnostic", "question-aware"])
def test_generate_with_kvzip(mode: str) -> None:
    model, tok = make_tiny("llama"), char_tokenizer()
    contexts = ["the cat sat on the mat and the key is 42. " * 2, "a dog ran far away; the key is 17. " * 2]
    out = ckv.generate(
        model, tok, contexts, ["key?", "what key?"], method="kvzip", budget=0.4, mode=mode, window=4, max_new_tokens=3
    )
    assert len(out.answers) == 2 and out.method == "kvzip"
    full = ckv.generate(
        model, tok, contexts, ["key?", "what key?"], method="full", mode=mode, window=4, max_new_tokens=3
    )
    assert out.kv_bytes_full == full.kv_bytes_full and 0 < out.kv_bytes < full.kv_bytes  # the same prompt, compressed
    # nothing evicted: the reconstruction path (captured states, then continuation) decodes what the full cache does
    whole = ckv.generate(
        model, tok, contexts, ["key?", "what key?"], method="kvzip", budget=1.0, mode=mode, window=4, max_new_tokens=3
    )
    assert whole.answers == full.answers and whole.new_tokens == full.new_tokens
    critical = ckv.generate(
        model, tok, contexts, ["key?", "what key?"], method="critical-kvzip", budget=0.4, mode=mode, window=4
    )
    assert critical.kv_bytes == out.kv_bytes  # the same budgets (entries per layer and head)


def test_compressing_inside_the_prefill_or_while_decoding_is_refused() -> None:
    model = ckv.attach(make_tiny("llama"))
    ids, mask = padded_batch([30], seed=7)
    cache = ckv.CompressedCache.for_model(model, "kvzip", 0.3, window=4)
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"no reconstruction pass: compress with criticalkv\."),
    ):
        model(input_ids=ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match="decode"):
        ckv.generate(model, char_tokenizer(), "some context " * 4, "q?", method="kvzip", window=4, decode_budget=16)


def test_repeat_prompts() -> None:
    tok = char_tokenizer()
    plain = repeat_prompt(tok, chat=True)  # no chat template: the instruction then a newline, nothing skipped

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tok(text, add_special_tokens=False)["input_ids"])

    assert plain.ids == ids("\n\nRepeat the previous context exactly.\n") and plain.skip == 0
    tok.chat_template = (
        "{% for m in messages %}<bos>U:{{ m['content'] }}<eos>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    chat = repeat_prompt(tok, chat=True)
    assert chat.ids == ids("\n\nRepeat the previous context exactly.<eos>A:")
    assert chat.skip == 3  # "<bos>U:", the template's opening, is not repeated
    for bad in [{"ids": ()}, {"ids": (1,), "chunk": 0}, {"ids": (1,), "skip": -1}, {"ids": (True,)}]:
        with pytest.raises(ValueError, match="repeat prompt"):
            RepeatPrompt(**bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a RepeatPrompt"):
        prefill(ckv.attach(make_tiny("llama")), *padded_batch([20]), window=4, reconstruction=(5, 6))  # type: ignore[arg-type]


# --- against kvpress (the [bench] extra; kvpress pins transformers < 5.3, so usually skipped) -----

KVPRESS = import_kvpress()


@pytest.mark.skipif(KVPRESS is None, reason="kvpress is not installed (pip install 'criticalkv[bench]')")
@torch.no_grad()
def test_same_scores_and_kept_entries_as_kvpress(tmp_path: Path) -> None:
    """kvpress's ``KVzipPress`` on a tiny Llama saved with the character tokenizer (kvpress loads the
    tokenizer from ``name_or_path``). With no chat template kvpress repeats ``"\\n\\nRepeat the previous
    context exactly." + "\\n"`` then the whole context in one chunk, which is :func:`repeat_prompt`'s
    prompt, and its softmax then spans the context and the repeat, as ours always does.

    Where we differ on purpose: kvpress's ``n_sink=4`` scores of 1 are overwritten by the chunk's when
    the template has no opening (here), while ours always hold, so we compare with ``sinks=0``; over
    several chunks kvpress's softmax leaves out the other chunks' keys (ours is the attention the model
    really pays); and we always keep the window, which kvpress does not have, so the kept entries are
    checked against one top-k of kvpress's scores over all layers and heads with the window forced."""
    kvpress = KVPRESS
    model, tok = make_tiny("llama"), char_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    theirs_model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch([80], seed=8)

    class Recording(kvpress.KVzipPress):  # type: ignore[misc,name-defined]
        def compress_post(self, model: torch.nn.Module) -> None:
            self.recorded = self.score_val.clone()
            super().compress_post(model)

    press = Recording(compression_ratio=0.5)
    with press(theirs_model):
        theirs_model(input_ids=ids, past_key_values=DynamicCache())
    theirs = press.recorded[:, 0].float()  # (L, H_kv, T)

    window, budget = 4, 24
    states, _ = prefill(ckv.attach(model), ids, mask, window=window, reconstruction=repeat_prompt(tok))
    method = ckv.get_method("kvzip", sinks=0)
    assert method.scores is not None
    for layer, state in enumerate(states):
        torch.testing.assert_close(method.scores(state)[0], theirs[layer], rtol=1e-4, atol=1e-6)
    kept = torch.stack(method.keep_masks(states, torch.tensor([budget])))[:, 0]  # (L, H_kv, T)
    forced = theirs.clone()
    forced[..., -window:] = float("inf")
    top = torch.zeros(forced.numel(), dtype=torch.bool)
    top[forced.flatten().topk(kept.shape[0] * kept.shape[1] * budget).indices] = True
    assert torch.equal(kept, top.view_as(kept))


@pytest.mark.slow  # two small sweeps (about a minute on a loaded 2-core machine)
def test_a_sweep_runs_the_pass_once_and_leaves_the_other_methods_alone(tmp_path: Path) -> None:
    model, tok = ckv.attach(make_tiny("llama")), char_tokenizer()

    def sweep(out: Path, methods: list[str]) -> dict[tuple[str, float], dict[str, object]]:
        config = SweepConfig(
            out=out,
            tasks=["niah_single_1"],
            lengths=[400],
            methods=methods,
            budgets=[0.3, 1.0],
            samples=1,
            window=8,
            max_new_tokens=4,
            model="tiny",
            mode="question-agnostic",
        )
        run_sweep(config, model, tok)
        return {(r["method"], r["budget"]): r for r in sweep_results.read_results(out)}

    with_kvzip = sweep(tmp_path / "a", ["full", "snapkv", "kvzip", "critical-kvzip"])
    without = sweep(tmp_path / "b", ["full", "snapkv"])
    for key, record in without.items():  # the reconstruction pass changes nothing for the other methods
        assert with_kvzip[key]["prediction"] == record["prediction"]
        assert with_kvzip[key]["kl"] == pytest.approx(record["kl"], abs=1e-6)
    for name in ("kvzip", "critical-kvzip"):
        whole, compressed = with_kvzip[(name, 1.0)], with_kvzip[(name, 0.3)]
        assert whole["prediction"] == with_kvzip[("full", 1.0)]["prediction"] and whole["kl"] == pytest.approx(
            0.0, abs=1e-6
        )
        assert int(compressed["kv_bytes"]) < int(compressed["kv_bytes_full"])  # type: ignore[call-overload]


def test_kvzip_declares_the_reconstruction_pass() -> None:
    for name in ("kvzip", "critical-kvzip"):
        needs = ckv.get_method(name).needs
        assert needs.reconstruction and needs.prefill_only and needs.cross_layer
    assert ckv.get_method("critical-kvzip").needs.value_norms
    assert not any(ckv.get_method(n).needs.reconstruction for n in ckv.available_methods() if "kvzip" not in n)
