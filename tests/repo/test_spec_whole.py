"""Issue 43 step 1 kept true: the cache's options are parsed once at an edge into a ``CacheSpec`` and
travel whole, so the names of its storage options live in a handful of files and each check is
written once (``cache/spec.py``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "criticalkv"

#: the files that may spell a storage option: its name (defaults), its check and record fields
#: (the spec and the quantization), and its flag (the command line's one definition)
STORAGE_OPTION_HOMES = {
    "defaults.py",
    "cache/spec.py",
    "cache/quantized/precision.py",
    "commands/cache_options.py",
}


def files_naming(word: str) -> set[str]:
    pattern = re.compile(rf"\b{word}\b")
    return {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text())}


def test_the_group_size_is_spelled_in_at_most_five_files() -> None:
    """The issue's measure (``grep -rlw kv_group_size src`` <= 5): bench, eval, serve, the runtime
    and lm-eval carry the spec (or its ``KVQuantization``) instead of the keyword."""
    found = files_naming("kv_group_size")
    assert found <= STORAGE_OPTION_HOMES, (
        f"kv_group_size spelled outside the spec's homes: {sorted(found - STORAGE_OPTION_HOMES)}"
    )
    assert len(found) <= 5


def test_the_residual_is_spelled_only_where_the_group_size_is() -> None:
    found = files_naming("kv_residual")
    assert found <= STORAGE_OPTION_HOMES, sorted(found - STORAGE_OPTION_HOMES)


def test_a_modifier_without_what_it_modifies_is_checked_once() -> None:
    """'A group size needs kv_bits' and 'an interval needs a decode budget': one check each, in
    ``CacheSpec.of`` (every edge goes through it)."""
    for sentence in ("OptionError(storage_without_bits(", "OptionError(INTERVAL_WITHOUT_BUDGET)"):
        users = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if sentence in p.read_text()}
        assert users == {"cache/spec.py"}, (sentence, sorted(users))


#: modules outside the cache that resolve a budget, and why: kvpress is told how many entries to
#: keep (the bench's kvpress side), not asked whether a prompt fits
RESOLVES_A_BUDGET = {"bench/kvpress_decode.py"}


def test_compressibility_is_computed_once() -> None:
    """Whether a prompt can be compressed is ``CacheSpec.check_compressible``: no entry point
    resolves a budget against a prompt's length itself."""
    users = {str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if "resolve_budget(" in p.read_text()}
    edges = {u for u in users if u.split("/")[0] in {"serve", "eval", "bench", "runtime", "commands", "vllm"}}
    assert edges <= RESOLVES_A_BUDGET, sorted(edges - RESOLVES_A_BUDGET)
