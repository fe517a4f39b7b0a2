"""Following docs/contributing.md's worked examples literally on a copy of the tree: each example is a
series of ``python`` code blocks whose first line says what to do with the rest (``# ACTION: PATH``)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "contributing.md"


def guide_steps(actions: Sequence[str], guide: Path = GUIDE) -> list[tuple[str, str, str]]:
    """``(action, path, code)`` of every ``python`` block of ``guide`` whose first line is
    ``# ACTION: PATH`` with ``ACTION`` one of ``actions``, in the guide's order."""
    steps = []
    pattern = r"# (" + "|".join(map(re.escape, actions)) + r"): (\S+)"
    for block in re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S):
        first, _, code = block.partition("\n")
        match = re.fullmatch(pattern, first.strip())
        if match:
            steps.append((match.group(1), match.group(2), code))
    return steps


def copy_tree(tree: Path, parts: Sequence[str] = ("src", "tests", "pyproject.toml")) -> Path:
    """A copy of the repository's ``parts`` under ``tree`` (no caches), to follow a guide in."""
    for part in parts:
        if (ROOT / part).is_dir():
            shutil.copytree(ROOT / part, tree / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(ROOT / part, tree / part)
    return tree


def follow(steps: Sequence[tuple[str, str, str]], tree: Path, new: str, append: str, gap: str = "\n\n") -> None:
    """Do each step in ``tree``: ``new`` writes a new file, ``append`` adds to the end of a file after
    ``gap``, any other action inserts its code after the file's last top-level import line."""
    for action, path, code in steps:
        target = tree / path
        if action == new:
            assert not target.exists(), f"the guide's new file {path} already exists"
            target.write_text(code)
        elif action == append:
            target.write_text(target.read_text() + gap + code)
        else:
            lines = target.read_text().splitlines(keepends=True)
            last = max(i for i, line in enumerate(lines) if line.startswith(("from ", "import ")))
            target.write_text("".join([*lines[: last + 1], code, *lines[last + 1 :]]))
