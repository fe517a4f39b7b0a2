"""lm-eval runs for the tests: a tiny model saved as a folder both ``hf`` and ``criticalkv`` load,
the local fixture tasks (tests/fixtures/lmeval), and lm-eval's per-sample outputs side by side."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.conftest import make_tiny
from tests.helpers.tiny_tokenizer import char_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lmeval"
#: a chat template of printable characters only (the character tokenizer has one token each)
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def chat_tokenizer() -> Any:
    """The character tokenizer with :data:`CHAT_TEMPLATE`."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny(folder: Path) -> Path:
    """The tiny random Llama and the chat tokenizer saved in ``folder`` (a Hugging Face checkpoint)."""
    model = make_tiny("llama")
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


def task_folder(folder: Path) -> Path:
    """The fixture tasks' YAML files in ``folder``, their data paths made absolute."""
    folder.mkdir(parents=True, exist_ok=True)
    for source in FIXTURES.glob("*.yaml"):
        (folder / source.name).write_text(source.read_text().replace("{FIXTURES}", str(FIXTURES)))
    return folder


def evaluate(model: str, model_args: str, tasks: list[str], include: Path, **options: Any) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on the CPU with per-sample outputs logged."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the fixture tasks are local files
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    import criticalkv.eval.lmeval  # noqa: F401  (registers the criticalkv model)

    settings: dict[str, Any] = {"device": "cpu", "batch_size": 1, "log_samples": True, "bootstrap_iters": 0}
    settings.update(options)
    # lm-eval's CLI hands --metadata (RULER's tokenizer and lengths) to the task manager it builds;
    # a task manager passed in must carry it itself
    manager = TaskManager(include_path=str(include), metadata=settings.get("metadata"))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=manager, **settings)


def responses(results: dict[str, Any], task: str) -> list[Any]:
    """Each sample's raw responses, by document id."""
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]
