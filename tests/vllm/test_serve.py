"""``python -m criticalkv.vllm serve`` as users run it: vLLM's OpenAI server with the plugin, queried by
the official ``openai`` client on 127.0.0.1 (needs vLLM: ``make test-vllm``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

import criticalkv as ckv  # noqa: E402
from criticalkv.models import default_model_folder  # noqa: E402
from tests.helpers.vllm_reference import greedy_tokens  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    command = [sys.executable, "-m", "criticalkv.vllm", "serve", str(default_model_folder())]
    command += ["--method", "snapkv", "--budget", "0.2", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--dtype", "float32", "--block-size", "128", "--max-model-len", "2048"]
    command += ["--kv-cache-memory-bytes", str(128 << 20), "--served-model-name", "smollm2"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            client.models.list()
            break
        except openai.APIConnectionError:
            time.sleep(2)
    assert process.poll() is None, log.read_text()[-4000:]
    yield client, process, log
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)


def test_the_server_answers_with_the_compressed_cache(server: Any) -> None:
    client, _, log = server
    model, tokenizer = ckv.load_model(str(default_model_folder()))
    ckv.attach(model)
    text = (ROOT / "docs" / "methods.md").read_text()[:3000] + "\nQuestion: what is this about? Answer:"
    ids = tokenizer(text)["input_ids"]
    reply = client.completions.create(
        model="smollm2", prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = greedy_tokens(model, ids, "snapkv", 0.2, 32, 16)
    assert reply.choices[0].text == tokenizer.decode(expected)
    assert "criticalkv: compressing every prompt with" in log.read_text()


def test_sigterm_stops_the_server(server: Any) -> None:
    _, process, _ = server
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=120) is not None
