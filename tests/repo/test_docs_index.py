"""docs/index.md lists every page once (issue 29, point 10), and the docs' links land (docs/check_links.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "docs" / "index.md"


def test_the_index_lists_every_page_once() -> None:
    links = [m.split("#")[0] for m in re.findall(r"\]\(([^)\s]+\.md[^)\s]*)\)", INDEX.read_text())]
    twice = sorted(link for link, n in Counter(links).items() if n > 1)
    assert not twice, f"docs/index.md lists these more than once: {twice}"
    pages = {p.relative_to(INDEX.parent).as_posix() for p in INDEX.parent.glob("*.md")} - {"index.md"}
    results = {p.relative_to(INDEX.parent).as_posix() for p in (INDEX.parent / "results").glob("*.md")}
    missing = sorted((pages | results) - set(links))
    assert not missing, f"docs/index.md does not list {missing}"


def test_every_relative_link_and_anchor_lands() -> None:
    done = subprocess.run([sys.executable, "docs/check_links.py"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
