"""Every code block in README.md and docs/*.md runs as written, or says why not.

The rules (docs/contributing.md, "Code blocks in the docs"): a ``python`` or ``bash`` block runs as
written unless an HTML comment on the lines just above its opening fence says otherwise:

- ``<!-- example: excerpt: WHY -->``: not run (a synopsis, a GPU or cluster command, a fragment).
- ``<!-- example: small: OLD => NEW; OLD2 => NEW2 -->``: run with these text replacements (a cheap
  size of the same command).
- ``<!-- example: continues -->``: a Python block that runs after the page's previous Python block,
  in the same process (it uses the names that block defined).

Blocks run in a fresh temporary folder that holds the files the docs name (:data:`FILES`): a
``report.txt`` (and ``ctx.txt``) of about 900 tokens with a signature line, and ``mine.jsonl``.
Python runs in a subprocess on the default model as the block loads it (``load_model("default")``);
shell blocks run under ``bash -euo pipefail`` with ``criticalkv`` and ``python`` meaning this
checkout's command and interpreter. Each block is one test (its id: ``page:line``), marked slow
where it loads the default model.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
MARKER = re.compile(r"<!--\s*example:\s*(excerpt|small|continues)\s*(?::\s*(.*?))?\s*-->", re.S)


@dataclass
class Block:
    """One fenced code block of a page and the markers above it."""

    page: Path
    line: int
    language: str
    code: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    def replacements(self) -> list[tuple[str, str]]:
        """The ``small`` marker's ``OLD => NEW`` pairs."""
        pairs = []
        for part in self.markers.get("small", "").split(";"):
            if part.strip():
                old, sep, new = part.partition("=>")
                if not sep:
                    raise ValueError(f"{self.id}: a small: replacement needs 'OLD => NEW', not {part!r}")
                pairs.append((old.strip(), new.strip()))
        return pairs

    def runnable_code(self) -> str:
        """The code as it runs: the small variant's replacements applied (each must match)."""
        code = self.code
        for old, new in self.replacements():
            if old not in code:
                raise ValueError(f"{self.id}: the small: replacement {old!r} does not occur in the block")
            code = code.replace(old, new)
        return code


def markers_above(lines: list[str], fence: int) -> dict[str, str]:
    """The ``<!-- example: ... -->`` comments on the lines just above line index ``fence``."""
    found: dict[str, str] = {}
    i = fence - 1
    while i >= 0 and lines[i].strip().endswith("-->"):
        start = i
        while start >= 0 and "<!--" not in lines[start]:
            start -= 1
        match = MARKER.fullmatch("\n".join(lines[start : i + 1]).strip())
        if match is None:
            break
        found[match.group(1)] = (match.group(2) or "").strip()
        i = start - 1
    return found


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks (```` ```lang ```` ... ```` ``` ````), with their markers."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        code = "\n".join(lines[i + 1 : end]) + "\n"
        found.append(Block(page, i + 1, opening.group(1), code, markers_above(lines, i)))
        i = end + 1
    return found


ALL = [b for page in PAGES for b in blocks(page)]
TO_RUN = [b for b in ALL if RUNNABLE.get(b.language) and "excerpt" not in b.markers]

DOCUMENT = (
    "Minutes of the harbour board, 14 March 1921.\n\n"
    + " ".join(
        f"Item {n}: the board reviewed the accounts of pier {n}, the dredging of berth {n % 7} and the "
        f"lighting of the eastern quay; the clerk read the letters received since the last meeting."
        for n in range(1, 21)
    )
    + "\n\nThe minutes were signed by the chairman, Mrs. Eleanor Whitcombe.\n"
)
#: the files the docs' examples read, written into each block's working folder
FILES: dict[str, str] = {
    "report.txt": DOCUMENT,
    "ctx.txt": DOCUMENT,
    "mine.jsonl": "".join(
        json.dumps({"context": DOCUMENT, "question": q, "answers": [a]}) + "\n"
        for q, a in [("Who signed the minutes?", "Whitcombe"), ("On what date was the meeting?", "14 March 1921")]
    ),
}


def python_source(block: Block) -> str:
    """The block's code, after the code of the blocks it continues on its page."""
    page = [b for b in ALL if b.page == block.page and RUNNABLE.get(b.language) == "python"]
    chain = [block]
    index = page.index(block)
    while "continues" in chain[0].markers:
        if index == 0:
            raise ValueError(f"{block.id}: 'continues', but no Python block comes before it on its page")
        index -= 1
        chain.insert(0, page[index])
    return "\n".join(b.runnable_code() for b in chain)


def shims(folder: Path) -> dict[str, str]:
    """An environment where ``criticalkv`` and ``python`` are this checkout's command and interpreter."""
    bin_dir = folder / "_bin"
    bin_dir.mkdir()
    commands = {"criticalkv": f"{shlex.quote(sys.executable)} -m criticalkv.cli", "python": shlex.quote(sys.executable)}
    for name, command in commands.items():
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\nexec {command} "$@"\n')
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    pythonpath = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": pythonpath, "MPLBACKEND": "Agg"}


def test_the_markers_parse_and_every_page_has_blocks() -> None:
    assert len(ALL) > 20 and TO_RUN, "no code blocks found"
    for block in ALL:
        block.runnable_code()  # every small: replacement occurs in its block
        if "continues" in block.markers:
            assert RUNNABLE.get(block.language) == "python", f"{block.id}: 'continues' is for Python blocks"
            python_source(block)
        if "excerpt" in block.markers:
            assert block.markers["excerpt"], f"{block.id}: an excerpt says why it does not run"


def test_the_parser_reads_stacked_markers(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text(
        "text\n<!-- example: small: 10 => 1; a => b -->\n<!-- example: continues -->\n```python\nx = 10\n```\n"
        "<!-- example: excerpt: a synopsis -->\n```bash\nmake demo\n```\n```\nplain\n```\n"
    )
    found = blocks(page)
    assert [b.language for b in found] == ["python", "bash", ""]
    assert found[0].markers == {"small": "10 => 1; a => b", "continues": ""}
    assert found[0].replacements() == [("10", "1"), ("a", "b")]
    assert found[1].markers == {"excerpt": "a synopsis"}
    assert found[2].markers == {}


@pytest.mark.slow
@pytest.mark.parametrize("block", TO_RUN, ids=[b.id for b in TO_RUN])
def test_the_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    env = shims(tmp_path)
    if RUNNABLE[block.language] == "python":
        command = [sys.executable, "-c", python_source(block)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.runnable_code()]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    shown = f"{block.runnable_code()}\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    assert done.returncode == 0, f"{block.id} failed:\n{shown}"
