"""``python -m criticalkv.vllm serve`` as users run it: vLLM's OpenAI server with the plugin, queried by
the official ``openai`` client on 127.0.0.1 (needs vLLM: ``make test-vllm``)."""

from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
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
    model, tokenizer = ckv.load_model(str(default_model_folder()), dtype="float32")  # as the server
    ckv.attach(model)
    text = (ROOT / "docs" / "methods.md").read_text()[:3000] + "\nQuestion: what is this about? Answer:"
    ids = tokenizer(text)["input_ids"]
    reply = client.completions.create(
        model="smollm2", prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = greedy_tokens(model, ids, "snapkv", 0.2, 32, 16)
    assert reply.choices[0].text == tokenizer.decode(expected)
    assert "criticalkv: compressing every prompt with" in log.read_text()


def _usage(base: str) -> tuple[float, float, int]:
    """(running requests, KV cache usage, blocks in vLLM's pool) from vLLM's /metrics."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    running = float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    usage = float(re.search(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)", text, re.M).group(1))  # type: ignore[union-attr]
    blocks = int(re.search(r'num_gpu_blocks="(\d+)"', text).group(1))  # type: ignore[union-attr]
    return running, usage, blocks


def test_a_decoding_request_holds_only_its_kept_blocks(server: Any) -> None:
    """Read from vLLM's own /metrics (its engine core runs in a process of its own here): while one
    compressed request decodes, the pool's usage is that of its kept entries, not of its prompt."""
    client, _, _ = server
    base = str(client.base_url).removesuffix("/v1/")
    ids = list(range(1000, 1800))  # 800 tokens: 7 blocks of 128 whole, kept 160: 2 blocks
    answer = threading.Thread(
        target=lambda: client.completions.create(
            model="smollm2", prompt=ids, max_tokens=120, temperature=0, extra_body={"ignore_eos": True}
        )
    )
    answer.start()
    samples = []
    while answer.is_alive():
        samples.append(_usage(base))
        time.sleep(0.2)
    answer.join()
    decoding = [usage * blocks for running, usage, blocks in samples if running == 1 and usage > 0]
    assert decoding, "no sample while the request ran"
    kept = math.ceil((160 + 120) / 128) + 1
    assert min(decoding) <= kept + 0.01 < 7


def test_sigterm_stops_the_server(server: Any) -> None:
    _, process, _ = server
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=120) is not None
