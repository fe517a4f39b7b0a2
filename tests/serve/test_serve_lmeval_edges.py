"""lm-eval's API clients against a live ``criticalkv serve`` on tasks of our own making with edge
tokens (issue 41): emoji and CJK split across byte-level tokens, a generate task with 6 ``until``
strings (lm-eval adds its end-of-sequence text: 7 stops), and ``num_concurrent=8`` against
``max_sessions`` 2; the log-likelihoods equal the in-process model's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from criticalkv import attach
from criticalkv.models import load_model
from tests.helpers.lmeval_tasks import evaluate, responses
from tests.helpers.serve_helpers import live_server, server_config
from tests.serve.test_serve_token_text import byte_level_tokenizer, tiny_llama_for

pytestmark = pytest.mark.slow  # five lm-eval runs, three through HTTP

CHOICES = [
    ("The parrot's name: ", ["🦜 Polly", "東京タワー", "naïve café", "½ 👩‍👩‍👧"], 0),
    ("日本の首都は", ["東京です", "大阪です", "京都です ✨", "🎉"], 0),
    ("Emoji weather: ", ["☀️☀️", "🌧 rain", "雪", " snow ❄️"], 3),
    ("한국어: ", ["안녕하세요", "감사합니다 🙏", "네", " 아니요"], 1),
]
UNTIL = ["\n", ".", "。", "🦜", "!", "Q:"]  # six; lm-eval adds the tokenizer's end-of-sequence text

TASKS = {
    "edge_choice": {
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    },
    "edge_generate": {
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{choices[0]}}",
        "generation_kwargs": {"until": UNTIL, "max_gen_toks": 6, "do_sample": False},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    },
}


def _task_folder(root: Path) -> Path:
    data = root / "edges.jsonl"
    rows = [{"question": q, "choices": c, "label": label} for q, c, label in CHOICES]
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    folder = root / "tasks"
    folder.mkdir()
    for name, spec in TASKS.items():
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}}}
        task.update(test_split="test", metadata={"version": 1.0}, **spec)
        (folder / f"{name}.yaml").write_text(json.dumps(task, ensure_ascii=False), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("lmeval-edges")
    tokenizer, folder = byte_level_tokenizer(), root / "tiny"
    model = tiny_llama_for(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    served, _ = load_model(folder, device="cpu")
    config = server_config(root / "store", method="full", budget=1.0, methods=(), max_sessions=2)
    with live_server(config, model=attach(served), tokenizer=tokenizer) as (url, _):
        yield url, folder, _task_folder(root)


def _scores(results: dict[str, Any]) -> list[list[tuple[float, bool]]]:
    return [[tuple(choice[0]) for choice in sample] for sample in responses(results, "edge_choice")]


@pytest.mark.parametrize("concurrent", [1, 8])
def test_local_completions_log_likelihoods_equal_the_in_process_model_on_edge_tokens(
    setup: tuple[str, Path, Path], concurrent: int
) -> None:
    url, folder, tasks = setup
    args = (
        f"model=tiny,base_url={url}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
        f"tokenized_requests=True,num_concurrent={concurrent},max_retries=3"
    )  # 8 at once against max_sessions 2: the others wait for a slot (or back off by Retry-After)
    served = evaluate("local-completions", args, ["edge_choice"], tasks)
    ours = evaluate("criticalkv", f"pretrained={folder},method=full", ["edge_choice"], tasks)
    for mine, theirs in zip(_scores(served), _scores(ours), strict=True):
        for (ll, greedy), (ll_ref, greedy_ref) in zip(mine, theirs, strict=True):
            assert ll == pytest.approx(ll_ref, abs=1e-4)
            assert greedy == greedy_ref


def test_a_task_with_six_until_strings_runs_through_the_server(setup: tuple[str, Path, Path]) -> None:
    url, folder, tasks = setup
    args = (
        f"model=tiny,base_url={url}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
        "tokenized_requests=False,num_concurrent=1,max_retries=1"
    )
    served = evaluate("local-completions", args, ["edge_generate"], tasks)
    answers = [r[0] for r in responses(served, "edge_generate")]
    assert len(answers) == len(CHOICES)
    assert not any(stop in answer for answer in answers for stop in UNTIL)
