"""``/v1/completions`` output that matches its tokens (issue 41, section 1), on a live server with a
tiny random Llama over the default model's byte-level tokenizer, where emoji and CJK characters
are split across tokens: ``text``, ``tokens``, ``token_logprobs`` and ``text_offset`` describe one
token sequence, one entry per token, prompt and completion alike; booleans are not numbers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from criticalkv import attach
from criticalkv.models import default_model_folder
from criticalkv.serve import Engine
from criticalkv.serve.token_text import token_pieces
from tests.helpers.serve_helpers import live_server, server_config

EDGE_TEXTS = [
    "The capital of France is",
    "Parrot 🦜 flew to 東京 at ½ past 9 — naïve café 👩‍👩‍👧",
    "日本語のテキストと한국어 텍스트 ✨🎉",
]


def byte_level_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(default_model_folder())


def tiny_llama_for(tokenizer: Any, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama with ``tokenizer``'s vocabulary (49,152 tokens for the default's)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Engine]]:
    tokenizer = byte_level_tokenizer()
    config = server_config(tmp_path_factory.mktemp("store"), method="full", budget=1.0, max_new_tokens=16)
    with live_server(config, attach(tiny_llama_for(tokenizer)), tokenizer) as running:
        yield running


def post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=120)


def check_consistent(text: str, logprobs: dict[str, Any], count: int) -> None:
    """One entry per token; the tokens' pieces concatenated are the text, each at its offset."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    assert len(tokens) == len(offsets) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == count
    assert "".join(tokens) == text
    assert all(text[at : at + len(piece)] == piece for at, piece in zip(offsets, tokens, strict=True))
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert not any("\ufffd" in piece for piece in tokens)


def test_token_pieces_concatenate_to_the_decoded_text() -> None:
    tokenizer = byte_level_tokenizer()
    for text in EDGE_TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = token_pieces(tokenizer, ids).pieces
        assert len(pieces) == len(ids) and "".join(pieces) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in p for p in pieces)
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokenizer(EDGE_TEXTS[1])["input_ids"])  # split characters


@pytest.mark.parametrize("text", EDGE_TEXTS)
def test_echo_text_tokens_and_offsets_describe_one_token_sequence(server: tuple[str, Engine], text: str) -> None:
    url, engine = server
    ids = list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])
    for prompt in (text, ids):
        echo = post(url, {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 8}).json()["choices"][0]
        generated = len(echo["logprobs"]["tokens"]) - len(ids)
        assert generated >= 1 and echo["text"].startswith(text)
        check_consistent(echo["text"], echo["logprobs"], len(ids) + generated)
        alone = post(url, {"prompt": prompt, "logprobs": 2, "max_tokens": 8}).json()["choices"][0]
        assert text + alone["text"] == echo["text"]  # the completion as it follows the prompt: no space lost
        check_consistent(alone["text"], alone["logprobs"], generated)
        assert alone["logprobs"]["token_logprobs"] == pytest.approx(echo["logprobs"]["token_logprobs"][len(ids) :])


def test_a_completion_keeps_its_leading_space(server: tuple[str, Engine]) -> None:
    """The random model's answers to these prompts include ones that start with a space (the
    byte-level vocabulary's words do): the text keeps it, with echo or without."""
    url, engine = server
    starts = []
    for seed in range(6):
        prompt = f"{EDGE_TEXTS[0]} {seed}"
        alone = post(url, {"prompt": prompt, "max_tokens": 4}).json()["choices"][0]["text"]
        echo = post(url, {"prompt": prompt, "max_tokens": 4, "echo": True}).json()["choices"][0]["text"]
        ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert echo == prompt + alone
        generated = engine.tokenizer(echo, add_special_tokens=False)["input_ids"][len(ids) :]
        assert alone == engine.tokenizer.decode(generated)  # exactly the tokens' text
        starts.append(alone[:1])
    assert " " in starts  # the case the test is about occurred


def test_a_stop_inside_a_token_ends_text_and_tokens_together(server: tuple[str, Engine]) -> None:
    """A stop string that starts inside a generated token of several characters: the text ends
    before it, and the tokens (up to that one, its piece cut there) still concatenate to the text."""
    url, _ = server
    prompt = EDGE_TEXTS[1]
    full = post(url, {"prompt": prompt, "max_tokens": 12, "logprobs": 0}).json()["choices"][0]
    pieces = full["logprobs"]["tokens"]
    at = next(i for i, piece in enumerate(pieces) if len(piece.strip()) >= 3 and i > 0)
    stop = pieces[at].strip()[1:]  # starts inside token ``at``
    cut = full["text"].find(stop)
    done = post(url, {"prompt": prompt, "max_tokens": 12, "logprobs": 0, "stop": [stop]}).json()["choices"][0]
    assert done["text"] == full["text"][:cut] and done["finish_reason"] == "stop"
    check_consistent(done["text"], done["logprobs"], len(done["logprobs"]["tokens"]))
    assert done["logprobs"]["token_logprobs"] == full["logprobs"]["token_logprobs"][: len(done["logprobs"]["tokens"])]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": [True, False]}, "prompt"),
        ({"prompt": [[True, 5]]}, "prompt"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "budget": True}, "budget"),
        ({"prompt": "hi", "window": True}, "window"),
        ({"prompt": "hi", "temperature": False}, "temperature"),
        ({"prompt": "hi", "n": True}, "n"),
    ],
)
def test_booleans_are_not_numbers(server: tuple[str, Engine], body: dict[str, Any], param: str) -> None:
    url, _ = server
    response = post(url, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == param


def test_booleans_are_not_numbers_in_chat(server: tuple[str, Engine]) -> None:
    url, _ = server
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({"max_tokens": True}, {"max_completion_tokens": True}, {"budget": True}, {"seed": True}):
        body = {"model": "tiny", "messages": messages, **extra}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 400, (extra, response.text)


def test_a_prompt_longer_than_the_context_is_400_on_every_path(server: tuple[str, Engine], tmp_path: Path) -> None:
    """Echo with logprobs and max_tokens 0 (no generation) too: a 400, not a bare 500."""
    url, engine = server
    ids = [100] * (engine.max_positions + 5)
    for body in (
        {"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0},
        {"prompt": ids, "echo": True, "max_tokens": 0},
        {"prompt": ids, "max_tokens": 1},
        {"prompt": [[5, 6], ids], "echo": True, "max_tokens": 0},
    ):
        response = post(url, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
    assert engine.admitted() == 0
