"""``criticalkv serve``'s environment checked at start (issue 41, section 4): one sentence, exit 2,
before a model is loaded; an API key with a trailing newline is the key without it."""

from __future__ import annotations

import pytest

import criticalkv.serve
from criticalkv.cli import main


def test_a_junk_decode_mode_is_refused_at_start(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("CRITICALKV_DECODE", "junk")
    assert main(["serve", "--port", "1"]) == 2  # before loading a model: healthy, then 500 on every request
    err = capsys.readouterr().err.strip()
    assert "CRITICALKV_DECODE must be one of auto, op, native, not 'junk'" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("given", ["sekret\n", "sekret\r\n", "  sekret "])
def test_an_api_key_with_a_trailing_newline_is_stripped(monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    seen: list[str | None] = []

    class Stop(Exception):
        pass

    def binding(host: str, api_key: str | None, force: bool) -> None:
        seen.append(api_key)
        raise Stop  # the key as the server would use it; nothing more is started

    monkeypatch.setattr(criticalkv.serve, "check_binding", binding)
    monkeypatch.setenv("CRITICALKV_API_KEY", given)
    with pytest.raises(Stop):
        main(["serve", "--port", "1"])
    monkeypatch.delenv("CRITICALKV_API_KEY")
    with pytest.raises(Stop):
        main(["serve", "--port", "1", "--api-key", given])
    assert seen == ["sekret", "sekret"]


def test_admission_wait_is_checked(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--port", "1", "--admission-wait", "-1"]) == 2
    assert "--admission-wait must be" in capsys.readouterr().err
