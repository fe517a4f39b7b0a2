"""Every optional command says which extra to install, in one line, before it loads a model."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import criticalkv.models
from criticalkv.cli import main
from criticalkv.commands.common import UsageError, require_extra

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading a model fails the test: the refusal must come first."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the missing extra was named")

    monkeypatch.setattr(criticalkv.models, "load_model", refuse)


def _hide(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for name in modules:  # as where the extra is not installed: find_spec and import both fail
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.usefixtures("no_model")
@pytest.mark.parametrize(
    ("argv", "hidden", "extra"),
    [
        (["serve", "--model", "default"], ["fastapi"], "serve"),
        (["serve", "--model", "default"], ["uvicorn"], "serve"),
        (["serve", "--ray", "--store", "{tmp}"], ["ray"], "ray-serve"),
        (["lm-eval", "--help"], ["lm_eval"], "lm-eval"),
        (["lm-eval", "--model", "criticalkv", "--tasks", "x"], ["lm_eval"], "lm-eval"),
        (["eval", "--dataset", "x.jsonl", "--out", "{tmp}/out", "--ray", "auto"], ["ray"], "ray"),
        (["bench", "--kvpress", "on"], ["kvpress"], "bench"),
    ],
    ids=["serve-fastapi", "serve-uvicorn", "serve-ray", "lm-eval-help", "lm-eval", "eval-ray", "bench-kvpress"],
)
def test_a_missing_extra_is_one_line_naming_it(
    argv: list[str],
    hidden: list[str],
    extra: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _hide(monkeypatch, *hidden)
    assert main([part.format(tmp=tmp_path) for part in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    assert f"pip install -e '.[{extra}]'" in err and hidden[0] in err
    assert err.startswith(f"criticalkv: error: criticalkv {argv[0]}")


def test_installed_modules_pass_and_the_sentence_names_each_missing_one(monkeypatch: pytest.MonkeyPatch) -> None:
    require_extra("x", "y", "json", "pathlib")  # installed: nothing raised
    _hide(monkeypatch, "fastapi")
    with pytest.raises(UsageError, match=r"\[serve\] extra \(fastapi, no_such_module_ckv not installed\)"):
        require_extra("serve", "serve", "fastapi", "json", "no_such_module_ckv")


def test_the_readme_lists_every_extra() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    block = pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([a-z][a-z-]*) = \[", block, re.M)) - {"dev"}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("To install into") :][:1500]
    missing = sorted(e for e in extras if f"`{e}`" not in install)
    assert not missing, f"README's list of extras omits {missing}"
