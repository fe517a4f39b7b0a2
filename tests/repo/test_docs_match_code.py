"""Statements in the docs that the code can check: defaults, what is "not done yet", quoted numbers."""

from __future__ import annotations

import re
from pathlib import Path

from criticalkv.eval.lmeval.model_args import LMEvalOptions

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _section(text: str, heading: str) -> str:
    """The body of the markdown section ``heading`` (to the next heading of any level)."""
    start = text.index(heading) + len(heading)
    following = re.search(r"^#{1,6} ", text[start:], re.M)
    return text[start : start + following.start()] if following else text[start:]


def test_lm_eval_docs_defaults_are_the_models() -> None:
    table = _section((DOCS / "lm-eval.md").read_text(encoding="utf-8"), "### `model_args`")
    documented = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", table, re.M))
    spec = LMEvalOptions.parse(pretrained="default").spec
    assert documented["method"] == spec.method.name
    assert float(documented["budget"]) == spec.budget
    assert int(documented["window"]) == spec.window


def test_serving_not_done_yet_lists_nothing_the_server_does() -> None:
    not_done = _section((DOCS / "serving.md").read_text(encoding="utf-8"), "## Not done yet").lower()
    # multi-turn on a context: tests/serve (conversations); completions' logprobs: tests/serve (completions)
    assert "multi-turn" not in not_done
    assert not re.search(r"`logprobs`;", not_done), "completions return logprobs: say which route has none"


def test_readme_full_cache_scores_name_their_sweep() -> None:
    """The README quotes two full-cache RULER averages from two sweeps: each sentence says which."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = _section(readme, "Which to pick:").split("\n\n")[0]
    assert "61.2" in paragraph and "20-sample" in paragraph and "33.2" in paragraph
    ruler = (DOCS / "results" / "ruler-default.md").read_text(encoding="utf-8")
    methods = (DOCS / "methods.md").read_text(encoding="utf-8")
    assert "full cache: 61.2" in methods and "20-sample" in methods
    assert re.search(r"^full\s+1\.0 .* 33\.2 ", ruler, re.M)
