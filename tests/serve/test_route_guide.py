"""docs/contributing.md's route worked example, followed literally on a copy of the tree: the body,
the route's module and its registration (3 files), then the new route asked of a live server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.guide import GUIDE, copy_tree, follow, guide_steps

BODY, FILE, IMPORT, LISTED = (
    "route body appended to",
    "route file",
    "route import in",
    "route listed in ROUTES of",
)

#: run in the copy: a live server on the tiny model answers the new route
SCRIPT = """
import json, sys
from pathlib import Path

import httpx

from tests.helpers.serve_helpers import document, live_server, server_config

with live_server(server_config(Path(sys.argv[1]))) as (url, engine):
    long, short = (httpx.post(f"{url}/tokenize", json={"text": t}, timeout=60) for t in (document(1), "hi"))
    bad = httpx.post(f"{url}/tokenize", json={"text": 7}, timeout=60)
    print(json.dumps({"long": long.json(), "short": short.json(), "bad": bad.status_code,
                      "expected": len(engine.context_ids(document(1)))}))
"""


def list_in_routes(tree: Path, path: str, code: str) -> None:
    """Put ``code`` (a module's name and a comma) as the last entry of ``ROUTES`` in ``path``."""
    target = tree / path
    text = target.read_text()
    start = text.index("ROUTES = (")
    end = text.index("\n)", start)
    target.write_text(text[:end] + "\n    " + code.strip() + text[end:])


def test_a_new_route_is_three_files() -> None:
    steps = guide_steps((BODY, FILE, IMPORT, LISTED))
    assert [action for action, _, _ in steps] == [BODY, FILE, IMPORT, LISTED]
    assert len({path for _, path, _ in steps}) == 3
    assert "**3 files**" in GUIDE.read_text()


@pytest.mark.slow
def test_the_route_example_answers_on_a_live_server(tmp_path: Path) -> None:
    tree = copy_tree(tmp_path / "tree")
    steps = guide_steps((BODY, FILE, IMPORT, LISTED))
    follow([s for s in steps if s[0] != LISTED], tree, new=FILE, append=BODY)
    for _, path, code in (s for s in steps if s[0] == LISTED):
        list_in_routes(tree, path, code)
    env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}"}
    command = [sys.executable, "-c", SCRIPT, str(tmp_path / "store")]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    long, short = result["long"], result["short"]
    assert long["tokens"] == result["expected"] and long["kept_per_head"] is not None and long["not_compressed"] is None
    assert 0 < long["kept_per_head"] < long["tokens"]
    assert short["kept_per_head"] is None and "fewer than the observation window" in short["not_compressed"]
    assert result["bad"] == 400  # the body is checked as every body is (a number is not text)
