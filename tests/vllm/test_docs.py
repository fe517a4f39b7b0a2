"""docs/vllm.md's offline example runs as written, in the vLLM venv (``make test-vllm``)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MARKER = "tests/vllm/test_docs.py runs this block"


def offline_example() -> str:
    page = (ROOT / "docs" / "vllm.md").read_text()
    after = page[page.index(MARKER) :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)  # type: ignore[union-attr]


def test_the_offline_example_runs_as_written(tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(offline_example())
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    stats = next(line for line in reversed(done.stdout.splitlines()) if "'compressed'" in line)  # vLLM logs too
    assert "'compressed': 1" in stats and "'left_whole': 0" in stats
