"""docs/contributing.md's worked example, followed literally on a copy of the tree: the new method
file, its import and registration, then the shared test matrix run on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.guide import GUIDE, ROOT, copy_tree, follow, guide_steps

ACTIONS = ("file", "add to the imports of", "append to")
MATRIX = ["tests/cache/test_cache_oracle.py", "tests/methods/test_selection.py", "tests/cache/test_memory.py"]


def test_the_guide_has_the_three_steps() -> None:
    actions = [action for action, _, _ in guide_steps(ACTIONS)]
    assert actions == list(ACTIONS)


@pytest.mark.slow
def test_the_worked_example_passes_the_shared_matrix(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path / "tree")
    follow(guide_steps(ACTIONS), tree, new="file", append="append to")
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MATRIX, "-k", "vatp"]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", done.stdout).group(1))  # type: ignore[union-attr]
    assert passed >= 10, done.stdout[-2000:]  # oracle x 3 archs, invariants, memory
    assert "failed" not in done.stdout and "error" not in done.stdout.lower().split("passed")[-1]


def test_the_guide_describes_every_cache_subpackage() -> None:
    """Each subpackage of ``cache/`` has a bullet that opens with its docstring's summary (up to the colon)."""
    import ast

    text = GUIDE.read_text()
    cache = ROOT / "src" / "criticalkv" / "cache"
    rooms = sorted(p.parent.name for p in cache.glob("*/__init__.py"))
    assert rooms, "no subpackages found under src/criticalkv/cache"
    for room in rooms:
        docstring = ast.get_docstring(ast.parse((cache / room / "__init__.py").read_text())) or ""
        summary = docstring.split(":")[0].strip()
        assert summary, f"cache/{room}/__init__.py has no docstring summary"
        assert f"- `cache/{room}/`: {summary}" in " ".join(text.split()), f"docs/contributing.md lacks cache/{room}/"
