"""lm-eval itself as the client of a live ``criticalkv serve`` (127.0.0.1): ``local-completions`` for
a loglikelihood task and ``local-chat-completions`` for a generate task, scored as the in-process
``criticalkv`` lm-eval model scores them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from criticalkv import attach
from criticalkv.models import load_model
from tests.helpers.lmeval_tasks import chat_tokenizer, evaluate, responses, save_tiny, task_folder
from tests.helpers.serve_helpers import BUDGET, WINDOW, live_server, server_config

pytestmark = pytest.mark.slow  # four lm-eval runs, two through HTTP: about a minute here


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    root = tmp_path_factory.mktemp("lmeval-serve")
    folder, tasks = save_tiny(root / "tiny"), task_folder(root / "tasks")
    model, _ = load_model(folder, device="cpu")
    config = server_config(root / "store", method="critical-adakv", methods=("full",))
    with live_server(config, model=attach(model), tokenizer=chat_tokenizer()) as (url, _):
        yield url, folder, tasks


def _scores(results: dict[str, Any]) -> list[list[tuple[float, bool]]]:
    return [[tuple(choice[0]) for choice in sample] for sample in responses(results, "ckv_choice")]


def test_local_completions_scores_a_loglikelihood_task_as_the_in_process_model(setup: tuple[str, Path, Path]) -> None:
    url, folder, tasks = setup
    args = (
        f"model=tiny,base_url={url}/v1/completions,tokenizer={folder},tokenizer_backend=huggingface,"
        "tokenized_requests=True,num_concurrent=1,max_retries=1"
    )
    served = evaluate("local-completions", args, ["ckv_choice"], tasks)
    ours = evaluate("criticalkv", f"pretrained={folder},method=full", ["ckv_choice"], tasks)
    for mine, theirs in zip(_scores(served), _scores(ours), strict=True):
        for (ll, greedy), (ll_ref, greedy_ref) in zip(mine, theirs, strict=True):
            assert ll == pytest.approx(ll_ref, abs=1e-4)
            assert greedy == greedy_ref
    assert served["results"]["ckv_choice"]["acc,none"] == ours["results"]["ckv_choice"]["acc,none"]


def test_local_chat_completions_answers_a_generate_task_as_the_in_process_model(
    setup: tuple[str, Path, Path],
) -> None:
    url, folder, tasks = setup
    args = f"model=tiny,base_url={url}/v1/chat/completions,num_concurrent=1,max_retries=1"
    served = evaluate("local-chat-completions", args, ["ckv_generate"], tasks, apply_chat_template=True)
    spec = f"method=critical-adakv,budget={BUDGET},window={WINDOW}"
    ours = evaluate("criticalkv", f"pretrained={folder},{spec}", ["ckv_generate"], tasks, apply_chat_template=True)
    # the server strips an answer's leading whitespace, as its chat answers always were
    assert [r[0][0].strip() for r in responses(served, "ckv_generate")] == [
        r[0][0].strip() for r in responses(ours, "ckv_generate")
    ]
    assert ours["config"]["criticalkv"]["kv_ratio_mean_compressed"] <= BUDGET
    assert served["results"]["ckv_generate"]["exact_match,none"] == ours["results"]["ckv_generate"]["exact_match,none"]
