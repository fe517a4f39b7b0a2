"""The official ``openai`` client against a live server with the default model (slow)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

import criticalkv
from tests.helpers.serve_helpers import live_server, server_config
from tests.serve.test_serve import create

WINDOW, BUDGET, MAX_NEW = 32, 0.2, 12
CONTEXT = (
    "The museum's night guard, Ilse Marten, keeps the storeroom key in a blue tin under the front desk. "
    "Every Tuesday the east wing is closed for cleaning, and the café opens at nine instead of eight. "
    "The oldest exhibit is a bronze mirror found near the river in 1911; it is kept in room 14. "
) * 3
QUESTIONS = ["Where is the storeroom key kept?", "Which room holds the bronze mirror?"]


@pytest.mark.slow
def test_the_openai_client_gets_what_generate_answers(tmp_path: Path) -> None:
    model, tokenizer = criticalkv.load_model("default")
    config = server_config(
        tmp_path, model_name="default", budget=BUDGET, window=WINDOW, max_new_tokens=MAX_NEW,
        memory_cap_bytes=2**30, max_batch=4,
    )  # fmt: skip
    with live_server(config, criticalkv.attach(model), tokenizer) as (url, _):
        context_id = create(url, CONTEXT)["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        wants = []
        for question in QUESTIONS:
            want = criticalkv.generate(
                model, tokenizer, CONTEXT, question, method="critical-adakv", budget=BUDGET,
                mode="question-agnostic", window=WINDOW, max_new_tokens=MAX_NEW,
            ).answers[0]  # fmt: skip
            messages = [{"role": "user", "content": question}]
            extra = {"context_id": context_id}
            reply = client.chat.completions.create(
                model="default", messages=messages, max_tokens=MAX_NEW, extra_body=extra
            )  # fmt: skip
            assert reply.choices[0].message.content == want
            wants.append(want)
            chunks = client.chat.completions.create(
                model="default", messages=messages, max_tokens=MAX_NEW, extra_body=extra, stream=True
            )  # fmt: skip
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        assert any(wants)  # the model answers something (an empty answer may still be the right one)
