"""Architecture rules CI enforces on ``src/criticalkv`` (see ``tests/helpers/architecture.py``), and the
checkers themselves on tiny fake packages: one clean, one per kind of violation."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.architecture import (
    MAX_FUNCTION_LINES,
    MAX_LINES,
    decode_loops,
    face_violations,
    import_cycles,
    layering_violations,
    long_files,
    long_functions,
    method_probes,
    needs_readers,
    outside_face_violations,
    private_access,
    private_names_in_tests,
    read_package,
    room_cycles,
    room_faces_without_all,
    script_imports,
    shared_file_names,
    storage_namers,
    storage_probes,
    storage_subpackages,
)

SRC = Path(__file__).resolve().parents[2] / "src"
BENCHMARKS = SRC.parent / "benchmarks"
PACKAGE = SRC / "criticalkv"


def report(problem: str, fix: str, offenders: list[str]) -> str:
    return f"{problem} ({len(offenders)}); {fix}:\n  " + "\n  ".join(offenders)


# --- the real tree -------------------------------------------------------------------------------


def test_the_checkers_read_the_real_package() -> None:
    package = read_package(PACKAGE)
    assert len(package.files) > 50
    assert "criticalkv.state" in package.imports["criticalkv.cache.compressed_cache"]


def test_no_import_circles() -> None:
    cycles = import_cycles(PACKAGE)
    assert not cycles, report(
        "modules of src/criticalkv import each other in a circle",
        "move what both need into a lower module, or pass it in instead of importing it",
        cycles,
    )


def test_rooms_import_each_other_in_no_circle() -> None:
    cycles = room_cycles(PACKAGE)
    assert not cycles, report(
        "rooms of src/criticalkv (its subpackages and the package's face) import each other in a circle",
        "move the part that imports upward into the room above (as the head-score computation went to analysis/)",
        cycles,
    )


def test_core_imports_no_outer_code_and_no_forbidden_part() -> None:
    violations = layering_violations(PACKAGE)
    assert not violations, report(
        "the core imports app/experiment code (eval, analysis, bench, commands, cli, serve) or a forbidden"
        " part (cache -> headscores/models, scores/select/budgets -> cache)",
        "invert the dependency: the outer code passes what the core needs (a bound method, a checked model)",
        violations,
    )


def test_source_files_are_short() -> None:
    long = long_files(SRC)
    assert not long, report(f"source files over {MAX_LINES} lines", "split each into modules by concern", long)


def test_no_attribute_probing_of_methods() -> None:
    probes = method_probes(PACKAGE)
    assert not probes, report(
        "getattr/hasattr on a method or its parts (scores, budgets, select)",
        "give the part's base class the attribute or method (with a default) and use it directly",
        probes,
    )


#: the cache's storage subpackages (each defines a Storage): nothing outside each asks (isinstance) which
#: storage a layer holds; found, not listed, so a new storage is checked with no line here
STORAGES = tuple(storage_subpackages(PACKAGE, "criticalkv.cache"))


def test_the_storage_subpackages_are_found() -> None:
    assert {"layouts", "quantized"} <= set(STORAGES)  # the two storages of today; a new one adds itself


def test_code_outside_a_cache_subpackage_imports_only_its_face() -> None:
    violations = face_violations(PACKAGE, "criticalkv.cache")
    assert not violations, report(
        "modules import the inside of a cache subpackage",
        "import the name from the subpackage's __init__ (export it there if it belongs to its face)",
        violations,
    )


#: the cache's public face (issue 26): at most this many modules at the top of ``cache/``, the rest in rooms
MAX_CACHE_TOP_MODULES = 12


def test_the_cache_keeps_at_most_twelve_modules_at_its_top() -> None:
    top = sorted(path.name for path in (PACKAGE / "cache").glob("*.py"))
    assert len(top) <= MAX_CACHE_TOP_MODULES, report(
        f"modules at the top of cache/ (at most {MAX_CACHE_TOP_MODULES})",
        "move the module into the subpackage of its concern (docs/contributing.md, The cache's rooms)",
        top,
    )


def test_no_module_touches_another_modules_private_attributes() -> None:
    touched = private_access(PACKAGE)
    assert not touched, report(
        "modules read or write another module's _private attributes",
        "give the owner a public method or attribute for what the caller needs",
        touched,
    )


def test_nothing_outside_a_storage_asks_which_storage_it_is() -> None:
    probes = storage_probes(PACKAGE, "criticalkv.cache", STORAGES)
    assert not probes, report(
        "isinstance on a storage subpackage's class outside it",
        "add what the caller needs to the Storage interface (cache/storage.py) and implement it in each storage",
        probes,
    )


#: the one module that maps a storage spec type to its storage class (issue 43)
STORAGE_TABLE = "criticalkv.cache.storage_table"


def test_only_the_storage_table_names_a_storage_class() -> None:
    namers = storage_namers(PACKAGE, "criticalkv.cache", STORAGES, STORAGE_TABLE)
    assert not namers, report(
        "a storage subpackage's Storage class named outside it and the storage table",
        "build storages with criticalkv.cache.new_storage(spec), and register a new one in STORAGES "
        "(cache/storage_table.py)",
        namers,
    )


def test_functions_are_short() -> None:
    long = long_functions(PACKAGE)
    assert not long, report(
        f"functions over {MAX_FUNCTION_LINES} lines (docstrings not counted)",
        "split each by what it does (one job per function)",
        long,
    )


#: where what a method needs from the prefill is read: the cache, the Needs type and compress_prompt, and
#: the vLLM plugin's options (vLLM runs that prefill: the plugin says which needs it can capture there)
NEEDS_READERS = (
    "criticalkv.cache",
    "criticalkv.needs",
    "criticalkv.runtime.compress",
    "criticalkv.vllm.plugin_options",
)


def test_only_compress_prompt_reads_what_a_method_needs_from_the_prefill() -> None:
    readers = needs_readers(PACKAGE, NEEDS_READERS)
    assert not readers, report(
        "modules outside the cache read needs.queries or needs.reconstruction",
        "compress through criticalkv.runtime.compress_prompt / prompt_states, which read them",
        readers,
    )


#: file names that several modules share because they hold the same concept in parallel rooms (issue 43):
#: every module holding the name must be listed; any other module of that name is named by what it holds
PARALLEL_NAMES: dict[str, tuple[set[str], str]] = {
    "metrics.py": ({"serve.metrics", "serve.routes.metrics"}, "the server's counters and the route that shows them"),
    "scoring.py": (
        {"eval.tasks.scoring", "eval.longbench.scoring"},
        "answer scoring: RULER's string matching and partial credit, LongBench's metrics",
    ),
    "base.py": (
        {"budgets.base", "scores.base", "select.base", "eval.benchmarks.base"},
        "each room's base class (a budget, a score, a selection, a sweep benchmark)",
    ),
    "storage.py": (
        {"cache.storage", "cache.layouts.storage", "cache.quantized.storage"},
        "a layer's Storage: the interface and one implementation per storage subpackage",
    ),
    "paged.py": (
        {"cache.layouts.paged", "cache.quantized.paged", "vllm.paged"},
        "kept entries in paged blocks: each storage's block table for the decode op, vLLM's paged cache",
    ),
    "compress.py": ({"runtime.compress", "serve.compress"}, "compressing a prompt: the one way, the server's on it"),
    "compressor.py": (
        {"serve.compressor", "vllm.compressor"},
        "each server's compressing part (ours, vLLM's)",
    ),
    "engine.py": ({"serve.engine", "vllm.engine"}, "each server's engine (ours; vLLM's started with the plugin)"),
    "config.py": ({"bench.config", "eval.sweep.config", "serve.config"}, "each app room's options dataclass"),
    "folder.py": ({"runs.folder", "bench.folder"}, "a results folder's identity file (the shared one, the bench's)"),
    "runner.py": (
        {"bench.runner", "eval.sweep.runner", "eval.ray.runner", "vllm.runner"},
        "each room's run loop (bench, sweep, Ray sweep; vLLM's model runner, named as vLLM names it)",
    ),
    "worker.py": ({"eval.ray.worker", "vllm.worker"}, "the worker side of a framework (a Ray actor, a vLLM worker)"),
    "dataset.py": ({"eval.tasks.dataset", "eval.benchmarks.dataset"}, "a task's samples and its sweep benchmark"),
    "ruler.py": ({"eval.tasks.ruler", "eval.benchmarks.ruler"}, "a task's samples and its sweep benchmark"),
    "demo.py": ({"commands.demo", "eval.demo"}, "commands/X.py is the command line's edge of X"),
    "generate.py": ({"commands.generate", "runtime.generate"}, "commands/X.py is the command line's edge of X"),
}
#: shared file names of two concepts, in rooms another change edits now or with a public documented path:
#: to be renamed (docs/changelog.md, 2026-12-06, names a recommendation for each)


def test_modules_share_a_file_name_only_for_a_parallel_concept() -> None:
    allowed = {name: {f"criticalkv.{m}" for m in modules} for name, (modules, _) in PARALLEL_NAMES.items()}
    shared = shared_file_names(PACKAGE, allowed)
    assert not shared, report(
        "modules of src/criticalkv share a file name",
        "name the module by what it holds (analysis/run_spec.py, cache/batch/rows_cache.py), or list it in"
        " PARALLEL_NAMES with the reason if it is the same concept in a parallel room",
        shared,
    )


def test_shared_file_names_are_found(tmp_path: Path) -> None:
    root = write_package(tmp_path, {"eval/spec.py": "", "cache/spec.py": "", "analysis/spec.py": ""})
    assert shared_file_names(root, {}) == ["spec.py: pkg.analysis.spec, pkg.cache.spec, pkg.eval.spec"]
    assert shared_file_names(root, {"spec.py": {"pkg.analysis.spec", "pkg.cache.spec", "pkg.eval.spec"}}) == []
    assert shared_file_names(root, {"spec.py": {"pkg.cache.spec", "pkg.eval.spec"}}) != []  # a third one is not


#: private names of criticalkv that tests still touch, each with its reason (``path: use``)
TEST_PRIVATE_NAMES = {
    # a crash between writing the weights and the source record: a step no caller should be offered
    "tests/models/test_model_staging.py: setattr(ckv_default_model, '_write_source')",
}


def test_tests_use_no_private_name_of_the_library() -> None:
    found = private_names_in_tests(SRC.parent / "tests", SRC, "criticalkv", TEST_PRIVATE_NAMES)
    assert not found, report(
        "tests import, read or monkeypatch a _private name of criticalkv",
        "test through public behaviour, or make the seam public and documented (build.forget(), find_gguf())",
        found,
    )


def test_private_names_in_tests_are_found(tmp_path: Path) -> None:
    write_package(tmp_path, {"cache/build.py": "_loaded = {}\n"})
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pkg.cache.build as b\nfrom pkg.cache import build\nfrom pkg.cache.build import _loaded, __doc__\n"
        "from pkg import Cache\n\n"
        "def test(monkeypatch, obj):\n    build._loaded.clear()\n    monkeypatch.setattr(b, '_loaded', {})\n"
        "    monkeypatch.setattr('pkg.cache.build._loaded', {})\n    obj._private, Cache._x, build.__name__\n"
    )
    assert private_names_in_tests(tests, tmp_path, "pkg") == [
        "tests/test_x.py:3: from pkg.cache.build import _loaded",
        "tests/test_x.py:7: build._loaded",
        "tests/test_x.py:8: setattr(b, '_loaded')",
        "tests/test_x.py:9: setattr('pkg.cache.build._loaded')",
    ]
    assert private_names_in_tests(tests, tmp_path, "pkg", {"tests/test_x.py: build._loaded"})[1:2] == [
        "tests/test_x.py:8: setattr(b, '_loaded')"
    ]


def test_no_benchmark_script_imports_another() -> None:
    imports = script_imports(BENCHMARKS)
    assert not imports, report(
        "benchmarks/ scripts import another script",
        "move what they share into criticalkv.bench (prompts: bench/prompt.py, decode loops: bench/decode.py)",
        imports,
    )


def test_no_benchmark_script_writes_its_own_decode_loop() -> None:
    loops = decode_loops(BENCHMARKS)
    assert not loops, report(
        "benchmarks/ scripts step a model's decode by hand",
        "use criticalkv.bench.decode (Lockstep for caches stepped in turn, timed_decode for one cache)",
        loops,
    )


# --- the checkers on fake packages ---------------------------------------------------------------

CLEAN = {
    "__init__.py": "from pkg.cache import Cache\nfrom pkg.methods import Method\n",
    "state.py": "import torch\n",
    "models.py": "from pkg.state import State\n",
    "cache/__init__.py": "from pkg.cache.store import Cache\nfrom .layer import Layer\n",
    "cache/layer.py": "from pkg.state import State\n",
    # importing its own package's __init__ (which re-exports it) is no circle
    "cache/store.py": "from pkg import state\nfrom pkg.cache import layer\nfrom . import Layer\n",
    "scores/__init__.py": "from pkg.scores.base import Score\n",
    "scores/base.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.state import State\n",
    "methods.py": (
        "from pkg.scores import Score\n\n\n"
        "def probe(model, method):\n"
        "    getattr(model, 'select', None)  # the object is no method part\n"
        "    getattr(method_name, 'x')  # a longer name\n"
        "    method.parts.getattr(method, 'x')  # not the builtin\n"
        "    return hasattr(model.config, 'scores')\n"
    ),
    "eval/__init__.py": "",
    "eval/run.py": "from pkg.cache import Cache\nfrom pkg.analysis.plot import plot\n",  # outer -> core, outer
    "analysis/__init__.py": "",
    "analysis/plot.py": "import pkg.methods\n",
    "cli.py": "from pkg.eval import run\n",
    "long.py": "x = 1\n" * MAX_LINES,
}


def write_package(tmp_path: Path, changes: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {**CLEAN, **changes}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_clean_package_passes_every_check(tmp_path: Path) -> None:
    root = write_package(tmp_path, {})
    assert import_cycles(root) == []
    assert layering_violations(root) == []
    assert long_files(root) == []
    assert method_probes(root) == []
    assert read_package(root).imports["pkg.cache.store"] == {
        "pkg": 1,
        "pkg.state": 1,
        "pkg.cache": 2,
        "pkg.cache.layer": 2,
    }


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"state.py": "def f():\n    from pkg.cache.layer import Layer\n"}, ["pkg.cache.layer <-> pkg.state"]),
        (
            {"state.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.scores.base\n"},
            ["pkg.scores.base <-> pkg.state"],
        ),
        ({"cache/layer.py": "from .store import Cache\n"}, ["pkg.cache.layer <-> pkg.cache.store"]),
        # through a package __init__: pkg.models -> pkg.cache -> (pkg.cache.store ->) pkg.cache.layer -> pkg.models
        (
            {"models.py": "from pkg.cache import Layer\n", "cache/layer.py": "from ..models import load\n"},
            ["pkg.cache <-> pkg.cache.layer <-> pkg.cache.store <-> pkg.models"],
        ),
        (
            {
                "state.py": "import pkg.models\n",
                "scores/base.py": "from pkg import state\n",
                "models.py": "import pkg.scores.base",
            },
            ["pkg.models <-> pkg.scores.base <-> pkg.state"],
        ),
    ],
)
def test_import_cycles_are_found(tmp_path: Path, changes: dict[str, str], expected: list[str]) -> None:
    found = import_cycles(write_package(tmp_path, changes))
    assert [line.split(":")[0] for line in found] == expected


def test_a_cycle_names_the_imports_that_close_it(tmp_path: Path) -> None:
    (found,) = import_cycles(write_package(tmp_path, {"state.py": "\n\ndef f():\n    import pkg.cache.layer\n"}))
    assert "pkg.state -> pkg.cache.layer (pkg/state.py:4)" in found
    assert "pkg.cache.layer -> pkg.state (pkg/cache/layer.py:1)" in found


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"methods.py": "def f():\n    from pkg.eval.run import go\n"},
            "pkg.methods -> pkg.eval.run (pkg/methods.py:2)",
        ),
        ({"state.py": "import pkg.cli\n"}, "pkg.state -> pkg.cli (pkg/state.py:1)"),
        ({"__init__.py": "import pkg.analysis.plot\n"}, "pkg -> pkg.analysis.plot (pkg/__init__.py:1)"),
        ({"cache/layer.py": "from pkg import models\n"}, "pkg.cache.layer -> pkg.models (pkg/cache/layer.py:1)"),
        ({"headscores.py": "", "cache/store.py": "import pkg.headscores\n"}, "pkg.cache.store -> pkg.headscores"),
        ({"scores/base.py": "from ..cache.layer import Layer\n"}, "pkg.scores.base -> pkg.cache.layer"),
        ({"select.py": "from pkg.cache import Cache\n"}, "pkg.select -> pkg.cache (pkg/select.py:1)"),
        ({"budgets/__init__.py": "from pkg.cache.store import Cache\n"}, "pkg.budgets -> pkg.cache.store"),
        ({"headscores.py": "from pkg.runtime import attach\n", "runtime.py": ""}, "pkg.headscores -> pkg.runtime"),
    ],
)
def test_layering_violations_are_found(tmp_path: Path, changes: dict[str, str], expected: str) -> None:
    found = layering_violations(write_package(tmp_path, changes))
    assert len(found) == 1 and found[0].startswith(expected), found


def test_room_circles_are_found_through_the_face_too(tmp_path: Path) -> None:
    assert room_cycles(write_package(tmp_path, {})) == []
    # methods -> scores is fine; scores -> (the face ->) methods closes a circle
    (found,) = room_cycles(write_package(tmp_path, {"scores/base.py": "from pkg import Method\n"}))
    assert found.startswith("(face) <-> methods <-> scores: ")
    assert "pkg.scores.base -> pkg (pkg/scores/base.py:1)" in found


def test_long_files_are_found(tmp_path: Path) -> None:
    root = write_package(tmp_path, {"cache/long.py": "x = 1\n" * (MAX_LINES + 1)})
    assert long_files(root) == [f"pkg/cache/long.py: {MAX_LINES + 1} lines"]
    assert long_files(root, limit=MAX_LINES + 1) == []


@pytest.mark.parametrize(
    "call",
    [
        "getattr(self.budgets, 'cross_layer', False)",
        "hasattr(method, 'rank')",
        "getattr(methods[0].select, 'precision', None)",
        "getattr(wrap(scorer), 'queries_needed')",
        "hasattr(self.allocator.inner, 'x')",
        "getattr(selector or default, 'x', None)",
        "getattr(state.scores['a'], 'x')",
    ],
)
def test_method_probes_are_found(tmp_path: Path, call: str) -> None:
    root = write_package(
        tmp_path, {"select.py": f"def f(self, state, methods, method, scorer, selector):\n    {call}\n"}
    )
    assert method_probes(root) == [f"pkg/select.py:2: {call}"]


def test_long_functions_are_found(tmp_path: Path) -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))  # the def line makes it one too many
    docstring = '    """A docstring\n\n    of several lines is not counted."""\n'
    root = write_package(tmp_path, {"cache/long.py": f"def f():\n{docstring}{body}\n\ndef g():\n    pass\n"})
    assert long_functions(root) == [f"pkg/cache/long.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert long_functions(root, limit=MAX_FUNCTION_LINES + 1) == []


def test_imports_of_a_subpackages_inside_are_found(tmp_path: Path) -> None:
    changes = {"cache/room/__init__.py": "from pkg.cache.room.inner import X\n", "cache/room/inner.py": "X = 1\n"}
    assert face_violations(write_package(tmp_path, changes), "pkg.cache") == []
    changes["eval/run.py"] = "from pkg.cache.room.inner import X\nfrom pkg.cache.room import X\n"
    changes["cache/layer.py"] = "from pkg.cache.room import X\n"  # the face: fine
    found = face_violations(write_package(tmp_path, changes), "pkg.cache")
    assert found == ["pkg.eval.run -> pkg.cache.room.inner (pkg/eval/run.py:1)"]


def test_private_attributes_of_another_module_are_found(tmp_path: Path) -> None:
    owner = "class Layer:\n    def __init__(self):\n        self._tail = None\n\n    def _grow(self):\n        pass\n"
    reader = (
        "from typing import Protocol\n\n\nclass _Like(Protocol):\n    _tail: int\n\n\n"  # a declaration is no owner
        "def f(layer, other):\n    layer._grow()\n    other._tail = 1\n    return other._cached\n"
    )
    found = private_access(write_package(tmp_path, {"cache/layer.py": owner, "cache/store.py": reader}))
    assert sorted(found) == ["pkg/cache/store.py:10: other._tail", "pkg/cache/store.py:9: layer._grow"]


def test_storage_probes_are_found(tmp_path: Path) -> None:
    changes = {
        "cache/quantized/__init__.py": "",
        "cache/quantized/storage.py": "class QStorage:\n    pass\n\n\ndef f(s):\n    return isinstance(s, QStorage)\n",
        "cache/store.py": "def g(s, q):\n    return isinstance(s.storage, (int, q.QStorage))\n",
    }
    found = storage_probes(write_package(tmp_path, changes), "pkg.cache", ["quantized"])
    assert found == ["pkg/cache/store.py:2: isinstance(s.storage, (int, q.QStorage))"]


def test_needs_readers_are_found(tmp_path: Path) -> None:
    changes = {
        "runtime/compress.py": "def f(method):\n    return method.needs.reconstruction\n",
        "eval/unit.py": "def g(m, needs):\n    return m.needs.queries, needs.reconstruction, m.queries\n",
    }
    found = needs_readers(write_package(tmp_path, changes), ["pkg.runtime.compress"])
    assert found == ["pkg/eval/unit.py:2: m.needs.queries", "pkg/eval/unit.py:2: needs.reconstruction"]


def test_storage_classes_named_outside_the_table_are_found(tmp_path: Path) -> None:
    changes = {
        "cache/base.py": "class Storage:\n    pass\n",
        "cache/fp8/__init__.py": "from pkg.cache.fp8.store import Fp8Storage\n",
        "cache/fp8/store.py": "from pkg.cache.base import Storage\n\n\nclass Fp8Storage(Storage):\n    pass\n",
        "cache/table.py": "from pkg.cache.fp8 import Fp8Storage\n\nSTORAGES = {int: Fp8Storage}\n",
    }
    assert storage_namers(write_package(tmp_path, changes), "pkg.cache", ["fp8"], "pkg.cache.table") == []
    changes["cache/layer.py"] = (
        "from pkg.cache import fp8\nfrom pkg.cache.fp8 import Fp8Storage\n\nx = fp8.Fp8Storage()\n"
    )
    found = storage_namers(write_package(tmp_path, changes), "pkg.cache", ["fp8"], "pkg.cache.table")
    assert found == ["pkg/cache/layer.py:2: Fp8Storage", "pkg/cache/layer.py:4: Fp8Storage"]


def test_scripts_that_import_a_script_or_step_a_decode_by_hand_are_found(tmp_path: Path) -> None:
    (tmp_path / "shared.py").write_text("def prompt_ids():\n    pass\n")
    (tmp_path / "clean.py").write_text(
        "import json\nfrom criticalkv.bench.prompt import prompt_ids\n\nmodel(x, position_ids=p)\n"
    )
    assert script_imports(tmp_path) == [] and decode_loops(tmp_path) == []
    loop = "for _ in range(3):\n    out = model(input_ids=t, position_ids=p)\n"
    (tmp_path / "user.py").write_text("import shared\nfrom shared import prompt_ids\n\n" + loop)
    assert script_imports(tmp_path) == ["user.py:1: shared", "user.py:2: shared"]
    assert decode_loops(tmp_path) == ["user.py:5: model(..., position_ids=...)"]


#: eval's rooms (issue 43): at most this many modules at the top of ``eval/``, the rest in rooms
MAX_EVAL_TOP_MODULES = 6


def test_eval_keeps_at_most_six_modules_at_its_top() -> None:
    top = sorted(path.name for path in (PACKAGE / "eval").glob("*.py") if path.name != "__init__.py")
    assert len(top) <= MAX_EVAL_TOP_MODULES, report(
        f"modules at the top of eval/ (at most {MAX_EVAL_TOP_MODULES})",
        "move the module into the room of its concern (docs/contributing.md, eval's rooms)",
        top,
    )


def test_every_room_of_eval_has_a_face() -> None:
    faceless = room_faces_without_all(PACKAGE, "criticalkv.eval")
    assert not faceless, report(
        "rooms of eval/ whose __init__ sets no __all__",
        "list the names code outside the room may import in __all__",
        faceless,
    )


def test_code_outside_eval_imports_only_its_rooms_faces() -> None:
    violations = outside_face_violations(PACKAGE, "criticalkv.eval")
    assert not violations, report(
        "modules outside eval/ import the inside of one of its rooms",
        "import the name from the room's __init__ (export it there if it belongs to its face)",
        violations,
    )


def test_rooms_without_all_and_imports_past_a_face_from_outside_are_found(tmp_path: Path) -> None:
    changes = {
        "eval/room/__init__.py": "from pkg.eval.room.inner import X\n\n__all__ = ['X']\n",
        "eval/room/inner.py": "X = 1\n",
        "eval/bare/__init__.py": "from pkg.eval.bare.inner import Y\n",
        "eval/bare/inner.py": "Y = 1\n",
        "eval/other.py": "from pkg.eval.room.inner import X\n",  # inside eval: rooms may use each other
        "cli.py": "from pkg.eval.room.inner import X\nfrom pkg.eval.room import X\n",
    }
    root = write_package(tmp_path, changes)
    assert room_faces_without_all(root, "pkg.eval") == ["pkg/eval/bare/__init__.py"]
    assert outside_face_violations(root, "pkg.eval") == ["pkg.cli -> pkg.eval.room.inner (pkg/cli.py:1)"]
