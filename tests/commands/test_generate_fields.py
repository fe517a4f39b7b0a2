"""``generate --json``: docs/api.md names every field of the record (issue 29, point 3)."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from criticalkv.commands.generate import json_record
from criticalkv.runtime import GenerationResult

API = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _result() -> GenerationResult:
    values = {"answers": ["a"], "context_tokens": [9], "question_tokens": [2], "new_tokens": [1]}
    defaults = {f.name: values.get(f.name, 1) for f in fields(GenerationResult) if f.name not in ("budget",)}
    return GenerationResult(**{**defaults, "method": "snapkv", "mode": "question-aware", "budget": 0.2})


def test_the_docs_list_every_field_of_generate_json() -> None:
    record = json_record(_result(), "default", 1.0)
    paragraph = API.read_text().split("`generate --json` prints one JSON object with", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"`([a-z_0-9]+)`", paragraph))
    assert set(record) <= documented, f"docs/api.md does not name {sorted(set(record) - documented)}"
    assert {"storage_bits", "kv_bits_per_element", "kv_bits_per_element_final", "model"} <= set(record)
