"""The ``--device`` option and ``device`` fixture of ``tests/conftest.py``, on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import parse_device, tolerance, unavailable

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
PROBE = """
import torch


def test_device(device: torch.device) -> None:
    assert isinstance(device, torch.device)
    print("DEVICE", device)
"""


def test_the_fixture_is_the_cpu_by_default(device: torch.device, pytestconfig: pytest.Config) -> None:
    if pytestconfig.getoption("--device") == "cpu":
        assert device == torch.device("cpu")
    assert device == parse_device(pytestconfig.getoption("--device"))


@pytest.mark.parametrize("text", ["cpu", "cuda", "cuda:1", "mps", "xpu"])
def test_device_strings_parse(text: str) -> None:
    assert parse_device(text) == torch.device(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu", "is not a torch device"),
        ("cuda:x", "is not a torch device"),
        ("", "is not a torch device"),
        ("meta", "cannot run tests on 'meta'"),
    ],
)
def test_bad_device_strings_are_usage_errors(text: str, message: str) -> None:
    with pytest.raises(pytest.UsageError, match=message):
        parse_device(text)


def test_a_missing_device_gives_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    assert unavailable(torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert (
        unavailable(torch.device("cuda")) == "--device cuda: no cuda device here (torch.cuda.is_available() is False)"
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert unavailable(torch.device("cuda:0")) is None
    assert unavailable(torch.device("cuda:1")) == "--device cuda:1: this machine has 1 cuda device(s)"


def test_tolerances_stay_on_the_cpu() -> None:
    assert tolerance(1e-4, torch.device("cpu")) == 1e-4
    assert tolerance(1e-4, torch.device("cuda")) == pytest.approx(1e-3)
    assert tolerance(1e-4, torch.device("cuda"), accelerator=5e-4) == 5e-4


def run_probe(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_probe=PROBE)
    return pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s", "-rs", *args)


def test_pytest_runs_device_tests_on_the_cpu(pytester: pytest.Pytester) -> None:
    result = run_probe(pytester)
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*DEVICE cpu*"])


def test_pytest_skips_device_tests_without_the_device(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = run_probe(pytester, "--device", "cuda:1")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*--device cuda:1: no cuda device here*"])


def test_pytest_refuses_a_bad_device(pytester: pytest.Pytester) -> None:
    result = run_probe(pytester, "--device", "gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--device 'gpu' is not a torch device*"])
