"""matplotlib is the optional ``[plots]`` extra: the core never imports it, and a plot asked for
without it is one sentence with the install command, not a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from criticalkv.cli import main
from criticalkv.plotting import MissingMatplotlib, pyplot

SENTENCE = (
    "criticalkv: error: the plots need matplotlib, which is not installed: "
    "pip install -e '.[plots]' (in a clone; or: pip install 'matplotlib>=3.7')\n"
)


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import matplotlib`` fails, as where the extra is not installed."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _sweep_folder(folder: Path) -> Path:
    """A sweep folder with a few synthetic result lines (every field the report reads)."""
    folder.mkdir()
    lines = []
    for index in range(2):
        for method, budget in (("full", 1.0), ("snapkv", 0.2)):
            line = dict(task="t", length=100, index=index, method=method, budget=budget, score=1.0, partial=1.0)
            lines.append(line | dict(nll=1.0, kl=0.0, top1=1.0, kv_bytes=10, kv_bytes_full=10, meta={}))
    (folder / "results.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


@pytest.mark.usefixtures("no_matplotlib")
def test_pyplot_without_matplotlib_says_how_to_install_it() -> None:
    with pytest.raises(MissingMatplotlib, match=r"pip install -e '\.\[plots\]'"):
        pyplot()


@pytest.mark.usefixtures("no_matplotlib")
@pytest.mark.parametrize(
    "argv",
    [
        ["report", "{sweep}"],
        ["demo", "--out", "{out}"],
        ["bench", "--out", "{out}"],
        ["perturbation", "--out", "{out}"],
    ],
    ids=["report", "demo", "bench", "perturbation"],
)
def test_a_plot_without_matplotlib_is_one_sentence(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folders = {"sweep": str(_sweep_folder(tmp_path / "sweep")), "out": str(tmp_path / "out")}
    assert main([part.format(**folders) for part in argv]) == 2
    captured = capsys.readouterr()
    assert captured.err == SENTENCE
    if argv[0] == "report":  # the tables are written; only the plots are missing
        assert (tmp_path / "sweep" / "summary.csv").is_file()


def test_the_library_imports_no_matplotlib() -> None:
    code = (
        "import sys, criticalkv, criticalkv.cli, criticalkv.eval.report.sweep, criticalkv.eval.demo, "
        "criticalkv.analysis.experiment_report, criticalkv.bench.tables; "
        "sys.exit('matplotlib' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:] or "importing criticalkv imported matplotlib"
