"""The data files: every one is shipped by ``pyproject.toml``'s package-data and loads as a resource."""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

import pytest

from criticalkv import datafiles

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "src" / "criticalkv" / "data"

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def _shipped_patterns() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["setuptools"]["package-data"]["criticalkv"])


def test_every_data_file_is_package_data() -> None:
    files = {p for p in DATA.rglob("*") if p.is_file()}
    shipped = {p for pattern in _shipped_patterns() for p in DATA.parent.glob(pattern)}
    assert files and DATA / "haystack" / "kjv_genesis.txt" in files
    unshipped = sorted(str(p.relative_to(DATA.parent)) for p in files - shipped)
    assert not unshipped, f"add these to [tool.setuptools.package-data]: {unshipped}"


def test_data_files_load_as_resources() -> None:
    root = resources.files("criticalkv") / "data"
    for name in ("words/adjectives.txt", "haystack/noise.txt", "longbench/dataset2prompt.json"):
        assert root.joinpath(*name.split("/")).is_file()
    assert datafiles.read_lines("words/needle_keys.txt")[0] == "amber-harbor"
    assert datafiles.read_text("haystack/noise.txt").endswith("back again.\n")
    table = datafiles.read_json("longbench/dataset2maxlen.json")
    table["narrativeqa"] = 0  # a fresh object: the cached text is not changed
    assert datafiles.read_json("longbench/dataset2maxlen.json")["narrativeqa"] == 128
    with pytest.raises(FileNotFoundError):
        datafiles.read_text("words/no_such_list.txt")
