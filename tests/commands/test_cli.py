"""The ``criticalkv`` command: argument errors (fast) and end to end on the default model (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from criticalkv.cli import main
from criticalkv.commands import methods as methods_command
from criticalkv.commands.common import UsageError
from criticalkv.eval.tasks import make_needle_sample


def test_methods_lists_every_registered_method(capsys: pytest.CaptureFixture[str]) -> None:
    import criticalkv

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for name in criticalkv.available_methods():
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert "arXiv 2502.03805" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--method", "nope"], "unknown method"),
        (["--budget", "1.5"], "fraction"),
        (["--budget", "0"], "below 1"),
        (["--budget", "abc"], "neither a fraction"),
        (["--mode", "sideways"], "invalid choice"),
    ],
)
def test_generate_rejects_bad_arguments(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ctx = tmp_path / "c.txt"
    ctx.write_text("some context")
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--context-file", str(ctx), "--question", "q?", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("error", [ValueError("--lengths must be positive"), UsageError("no tasks given")])
def test_usage_errors_are_one_line(
    error: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(args: object) -> int:
        raise error

    monkeypatch.setattr(methods_command, "run", run)
    assert main(["methods"]) == 2
    assert capsys.readouterr().err == f"criticalkv: error: {error}\n"


def test_a_type_error_from_a_bug_shows_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def run(args: object) -> int:
        return len(3)  # type: ignore[arg-type]  # a bug

    monkeypatch.setattr(methods_command, "run", run)
    with pytest.raises(TypeError, match="has no len"):  # not caught: Python prints the traceback
        main(["methods"])
    assert "criticalkv: error" not in capsys.readouterr().err


def test_generate_rejects_missing_or_empty_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--context-file", str(tmp_path / "missing.txt"), "--question", "q?"]) == 2
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["generate", "--context-file", str(empty), "--question", "q?"]) == 2
    assert "empty" in capsys.readouterr().err
    ctx = tmp_path / "c.txt"
    ctx.write_text("context")
    assert main(["generate", "--context-file", str(ctx), "--question", "   "]) == 2
    assert "--question is empty" in capsys.readouterr().err


def _run_generate(context_file: Path, question: str, *extra: str) -> dict[str, object]:
    cmd = [sys.executable, "-m", "criticalkv.cli", "generate", "--model", "default", "--context-file"]
    cmd += [str(context_file), "--question", question, "--json", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def needle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    from criticalkv.models import load_model

    _, tokenizer = load_model("default")
    sample = make_needle_sample(tokenizer, 1024, seed=7)
    path = tmp_path_factory.mktemp("needle") / "context.txt"
    path.write_text(sample.context)
    return path, sample.question, sample.answer


@pytest.mark.slow
def test_generate_full_finds_the_needle(needle: tuple[Path, str, str]) -> None:
    path, question, answer = needle
    record = _run_generate(path, question, "--method", "full", "--budget", "1.0")
    assert answer in str(record["answer"])
    for key in ("method", "budget", "context_tokens", "kv_bytes", "kv_bytes_full", "ttft_s"):
        assert key in record
    assert record["kv_bytes"] == record["kv_bytes_full"]


@pytest.mark.slow
def test_generate_critical_adakv_compresses(needle: tuple[Path, str, str]) -> None:
    path, question, _ = needle
    record = _run_generate(path, question, "--method", "critical-adakv", "--budget", "0.2")
    assert isinstance(record["answer"], str) and record["answer"]
    assert record["method"] == "critical-adakv"
    assert float(record["kv_bytes"]) / float(record["kv_bytes_full"]) <= 0.22  # type: ignore[arg-type]
    assert int(record["context_tokens"]) > 1000  # type: ignore[call-overload]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``criticalkv --version`` prints the installed version and exits 0 (issue 29 asked for it)."""
    from criticalkv import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"criticalkv {__version__}"
