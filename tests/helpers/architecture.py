"""Architecture rules over a package's source, by reading it with :mod:`ast` (nothing is imported).

Every checker takes the root to check and returns its offenders as readable lines (empty: clean),
so that ``tests/repo/test_architecture.py`` can run it on ``src/criticalkv`` and on tiny fake packages.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

# experiment and app code (and the figures' plotting beside it): the core (everything else) never imports it
OUTER = frozenset({"eval", "analysis", "bench", "commands", "cli", "serve", "plotting"})
# (importing subpackage, imported subpackage) pairs that are forbidden even inside the core
FORBIDDEN = frozenset(
    {
        ("cache", "headscores"),
        ("cache", "models"),
        ("scores", "cache"),
        ("select", "cache"),
        ("budgets", "cache"),
        ("headscores", "runtime"),  # methods bind head scores: the model-running half lives in analysis/
    }
)
# names and attributes that denote a method or one of its parts
METHOD_PARTS = frozenset({"method", "select", "selector", "budgets", "allocator", "scores", "scorer"})
PROBES = frozenset({"getattr", "hasattr"})
MAX_LINES = 500


@dataclass(frozen=True)
class Package:
    """The modules of one package (``root`` is its directory) and their imports of each other."""

    root: Path
    files: dict[str, Path]  # module name -> file
    imports: dict[str, dict[str, int]]  # module -> {imported module of the package: first line}

    def location(self, module: str, target: str) -> str:
        path = self.files[module].relative_to(self.root.parent)
        return f"{module} -> {target} ({path}:{self.imports[module][target]})"

    def edges(self, module: str) -> list[str]:
        """Imports that count: not those of a package's own ``__init__`` (which re-exports it)."""
        return [
            t for t in self.imports[module] if not (self.files[t].name == "__init__.py" and module.startswith(t + "."))
        ]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(node: ast.AST, package: list[str]) -> list[str]:
    """Dotted names an import statement may load; ``package`` is the importing module's package."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = package[: len(package) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def read_package(root: Path) -> Package:
    """Every import anywhere in every module (functions and ``TYPE_CHECKING`` blocks included),
    resolved to the package's own modules."""
    files = {module_name(root, p): p for p in sorted(root.rglob("*.py"))}
    imports: dict[str, dict[str, int]] = {m: {} for m in files}
    for module, path in files.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            for name in imported_names(node, package):
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    line = getattr(node, "lineno", 0)
                    imports[module][name] = min(line, imports[module].get(name, line))
    return Package(root, files, imports)


def strongly_connected(nodes: Iterable[str], edges: dict[str, list[str]]) -> Iterator[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    yield sorted(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])


def import_cycles(root: Path) -> list[str]:
    """One line per circle of modules importing each other, with the imports that close it."""
    package = read_package(root)
    edges = {m: package.edges(m) for m in package.files}
    out = []
    for component in strongly_connected(sorted(package.files), edges):
        if len(component) > 1:
            inside = [package.location(m, t) for m in component for t in edges[m] if t in component]
            out.append(" <-> ".join(component) + ": " + "; ".join(sorted(inside)))
    return out


def subpackage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(root: Path) -> list[str]:
    """Imports from the core into outer (experiment/app) modules, and the forbidden core pairs."""
    package = read_package(root)
    out = []
    for module in sorted(package.files):
        for target in sorted(package.edges(module)):
            into_outer = subpackage(target) in OUTER and subpackage(module) not in OUTER
            if into_outer or (subpackage(module), subpackage(target)) in FORBIDDEN:
                out.append(package.location(module, target))
    return out


def room(module: str) -> str:
    """The room of a module: its top-level subpackage or module, ``""`` for the package's face."""
    return subpackage(module)


def _imported_modules(package: Package, module: str, path: Path) -> list[tuple[str, int]]:
    """The package's modules each import statement of ``module`` loads, with its line: ``from pkg import
    state`` is ``pkg.state`` (a submodule), ``from pkg import Name`` is ``pkg`` (the face that defines it)."""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = imported_names(node, base)
        if isinstance(node, ast.ImportFrom):
            names = [n for n in names[1:] if n in package.files] or names[:1]
        for name in names:
            while name and name not in package.files:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.append((name, getattr(node, "lineno", 0)))
    return out


def room_cycles(root: Path) -> list[str]:
    """Circles between the package's rooms (top-level subpackages and modules, and its face, whose
    imports count here: a room that imports the face imports every room the face names), each with
    the imports that close it: the layering is a graph with no arrow against it."""
    package = read_package(root)
    edges: dict[str, set[str]] = {room(m): set() for m in package.files}
    where: dict[tuple[str, str], str] = {}
    for module, path in sorted(package.files.items()):
        for target, line in _imported_modules(package, module, path):
            a, b = room(module), room(target)
            if a != b:
                edges[a].add(b)
                where.setdefault((a, b), f"{module} -> {target} ({path.relative_to(root.parent)}:{line})")
    out = []
    for component in strongly_connected(sorted(edges), {r: sorted(e) for r, e in edges.items()}):
        if len(component) > 1:
            inside = [where[(a, b)] for a in component for b in sorted(edges[a]) if b in component]
            out.append(" <-> ".join(r or "(face)" for r in component) + ": " + "; ".join(inside))
    return out


def long_files(root: Path, limit: int = MAX_LINES) -> list[str]:
    """Python files under ``root`` over ``limit`` lines, longest first."""
    sizes = [(len(p.read_text().splitlines()), p) for p in root.rglob("*.py")]
    return [f"{p.relative_to(root.parent)}: {n} lines" for n, p in sorted(sizes, key=lambda s: -s[0]) if n > limit]


def mentions_method(expression: ast.expr) -> bool:
    """Whether a name or attribute of ``expression`` denotes a method or one of its parts."""
    for node in ast.walk(expression):
        if isinstance(node, ast.Name) and node.id in METHOD_PARTS:
            return True
        if isinstance(node, ast.Attribute) and node.attr in METHOD_PARTS:
            return True
    return False


def method_probes(root: Path) -> list[str]:
    """``getattr``/``hasattr`` calls whose object (first argument) is a method or one of its parts."""
    out = []
    for path in sorted(root.rglob("*.py")):
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES
        ]
        for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
            if call.args and mentions_method(call.args[0]):
                out.append(f"{path.relative_to(root.parent)}:{call.lineno}: {ast.unparse(call)}")
    return out


MAX_FUNCTION_LINES = 60


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function, its docstring not counted."""
    body, skip = node.body, 0
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        skip = (first.end_lineno or first.lineno) - first.lineno + 1
    return (node.end_lineno or node.lineno) - node.lineno + 1 - skip


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions under ``root`` over ``limit`` lines (docstrings not counted), longest first."""
    rows = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _function_lines(node) > limit:
                rows.append((_function_lines(node), f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return [f"{where}: {n} lines" for n, where in sorted(rows, key=lambda r: -r[0])]


def subpackages(package: Package, parent: str) -> list[str]:
    """The subpackages directly inside ``parent`` (a package of ``package``)."""
    depth = parent.count(".") + 1
    return sorted(
        m
        for m, path in package.files.items()
        if path.name == "__init__.py" and m.startswith(parent + ".") and m.count(".") == depth
    )


def face_violations(root: Path, parent: str) -> list[str]:
    """Imports of a module inside a subpackage of ``parent`` (e.g. ``criticalkv.cache``) by code
    outside that subpackage: such code imports only the subpackage's ``__init__`` (its face)."""
    package = read_package(root)
    out = []
    for sub in subpackages(package, parent):
        for module in sorted(package.files):
            if module == sub or module.startswith(sub + "."):
                continue
            for target in sorted(package.imports[module]):
                if target.startswith(sub + "."):
                    out.append(package.location(module, target))
    return out


def _defined_private(tree: ast.AST) -> set[str]:
    """``_names`` a module defines: functions, classes, module and class-level names (not those a
    ``Protocol`` merely declares), and attributes it assigns on ``self``/``cls``."""
    names: set[str] = set()
    protocols = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("Protocol") for base in node.bases)
    ]
    declared = {id(n) for proto in protocols for stmt in proto.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in declared:
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_access(root: Path) -> list[str]:
    """Reads or writes of ``obj._name`` where ``_name`` belongs to another module of the package
    (defined there, not in the module that touches it); ``self._x`` and ``cls._x`` are the object's own."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in sorted(root.rglob("*.py"))}
    defined = {path: _defined_private(tree) for path, tree in trees.items()}
    everywhere = set().union(*defined.values()) if defined else set()
    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in everywhere and node.attr not in defined[path]:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


def storage_probes(root: Path, parent: str, storages: Iterable[str]) -> list[str]:
    """``isinstance`` checks naming a class of one of the ``storages`` subpackages of ``parent``
    (e.g. ``criticalkv.cache.quantized``) outside that subpackage: nothing else asks which storage
    a layer holds."""
    package = read_package(root)
    owned: dict[str, str] = {}  # class name -> its subpackage
    for sub in storages:
        for module, path in package.files.items():
            if module == f"{parent}.{sub}" or module.startswith(f"{parent}.{sub}."):
                for node in ast.walk(ast.parse(path.read_text())):
                    if isinstance(node, ast.ClassDef):
                        owned[node.name] = f"{parent}.{sub}"
    out = []
    for module, path in sorted(package.files.items()):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"):
                continue
            kinds = node.args[1:] and [n for n in ast.walk(node.args[1]) if isinstance(n, (ast.Name, ast.Attribute))]
            for kind in kinds or []:
                name = kind.id if isinstance(kind, ast.Name) else kind.attr
                home = owned.get(name)
                if home and not (module == home or module.startswith(home + ".")):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


#: what a method declares it needs from the prefill (criticalkv.needs.Needs), read where a prompt is compressed
PREFILL_NEEDS = frozenset({"queries", "reconstruction"})


def needs_readers(root: Path, allowed: Iterable[str]) -> list[str]:
    """Reads of ``needs.queries`` / ``needs.reconstruction`` (``x.needs.queries`` too) in modules
    other than ``allowed`` (module names; a package name allows what is inside it): one place
    decides how a prompt is prefilled for what a method needs."""
    package = read_package(root)
    allowed = tuple(allowed)
    out = []
    for module, path in sorted(package.files.items()):
        if any(module == a or module.startswith(a + ".") for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Attribute) and node.attr in PREFILL_NEEDS):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name == "needs":
                out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {ast.unparse(node)}")
    return out


def storage_subpackages(root: Path, parent: str) -> list[str]:
    """The subpackages of ``parent`` that define a storage (a ``class X(...Storage)``), by short name."""
    package = read_package(root)
    found = set()
    for sub in subpackages(package, parent):
        for module, path in package.files.items():
            if module == sub or module.startswith(sub + "."):
                for node in ast.walk(ast.parse(path.read_text())):
                    if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Storage") for b in node.bases):
                        found.add(sub.rpartition(".")[2])
    return sorted(found)


def storage_namers(root: Path, parent: str, storages: Iterable[str], table: str) -> list[str]:
    """Names of a storage class (a ``class X(Storage)`` of one of the ``storages`` subpackages of
    ``parent``) in a module other than its subpackage and the storage ``table`` (a module name):
    only the table maps a storage spec to its class, so a new storage is its subpackage plus one line."""
    package = read_package(root)
    owned: dict[str, str] = {}  # storage class name -> its subpackage
    for sub in storages:
        home = f"{parent}.{sub}"
        for module, path in package.files.items():
            if module == home or module.startswith(home + "."):
                for node in ast.walk(ast.parse(path.read_text())):
                    if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Storage") for b in node.bases):
                        owned[node.name] = home
    out = []
    for module, path in sorted(package.files.items()):
        if module == table:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            names += [node.id] if isinstance(node, ast.Name) else []
            names += [node.attr] if isinstance(node, ast.Attribute) else []
            for name in names:
                home = owned.get(name)
                if home and not (module == home or module.startswith(home + ".")):
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno}: {name}")
    return sorted(set(out))


def script_imports(folder: Path) -> list[str]:
    """Imports of one script of ``folder`` (e.g. ``benchmarks/``) by another: what scripts share lives
    in the package (``criticalkv.bench``), so each script runs from anywhere with ``PYTHONPATH=src``."""
    scripts = {path.stem for path in folder.glob("*.py")}
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            out += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] in scripts - {path.stem}]
    return out


def decode_loops(folder: Path) -> list[str]:
    """Decode steps written by hand in a script of ``folder``: a ``model(..., position_ids=...)`` call
    inside a loop (step caches with :class:`criticalkv.bench.decode.Lockstep` or ``timed_decode``)."""
    out = []
    for path in sorted(folder.glob("*.py")):
        for loop in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(loop, (ast.For, ast.While)):
                continue
            for node in ast.walk(loop):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "model"
                    and any(k.arg == "position_ids" for k in node.keywords)
                ):
                    out.append(f"{path.name}:{node.lineno}: {ast.unparse(node.func)}(..., position_ids=...)")
    return sorted(set(out))


def room_faces_without_all(root: Path, parent: str) -> list[str]:
    """The rooms (subpackages directly inside ``parent``) whose ``__init__`` sets no ``__all__``."""
    package = read_package(root)
    out = []
    for room in subpackages(package, parent):
        tree = ast.parse(package.files[room].read_text())
        targets = [
            t.id
            for node in tree.body
            if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Name)
        ]
        if "__all__" not in targets:
            out.append(str(package.files[room].relative_to(root.parent)))
    return out


def outside_face_violations(root: Path, parent: str) -> list[str]:
    """Imports by code outside ``parent`` (e.g. ``criticalkv.eval``) of a module inside one of its
    rooms: outside code imports a room's face (its ``__init__``); rooms inside may use each other."""
    return [line for line in face_violations(root, parent) if not line.startswith(parent + ".")]


def shared_file_names(root: Path, allowed: Mapping[str, Collection[str]]) -> list[str]:
    """File names (``__init__.py`` aside) that several modules of the package share, unless every
    module holding the name is one ``allowed[name]`` lists (the same concept in parallel rooms)."""
    names: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            names.setdefault(path.name, set()).add(module_name(root, path))
    return [
        f"{name}: {', '.join(sorted(modules))}"
        for name, modules in sorted(names.items())
        if len(modules) > 1 and not modules <= set(allowed.get(name, ()))
    ]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_aliases(tree: ast.AST, src: Path, package: str) -> dict[str, str]:
    """Names a file binds to a module of ``package`` (found as a file or folder under ``src``)."""

    def is_module(dotted: str) -> bool:
        path = src.joinpath(*dotted.split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    first = alias.name.split(".")[0]
                    aliases[alias.asname or first] = alias.name if alias.asname else first
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == package:
            for alias in node.names:
                if is_module(f"{node.module}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _private_uses(tree: ast.AST, aliases: Mapping[str, str], package: str) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == package:
            for alias in node.names:
                if _is_private(alias.name):
                    yield node.lineno, f"from {node.module} import {alias.name}"
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in aliases:
                yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "setattr" and node.args:
            first, name = node.args[0], node.args[1] if len(node.args) > 1 else None
            value = name.value if isinstance(name, ast.Constant) else None
            if isinstance(first, ast.Name) and first.id in aliases and isinstance(value, str) and _is_private(value):
                yield node.lineno, f"setattr({first.id}, {value!r})"
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                dotted = first.value.split(".")
                if dotted[0] == package and _is_private(dotted[-1]):
                    yield node.lineno, f"setattr({first.value!r})"


def private_names_in_tests(tests: Path, src: Path, package: str, allowed: Collection[str] = ()) -> list[str]:
    """Private names (``_x``, not dunders) of ``package`` (under ``src``) that the test files under
    ``tests`` import, read, assign or monkeypatch by name (``setattr(module, "_x", ...)``), as
    ``path:line: use``; a ``path: use`` in ``allowed`` is passed over (a reasoned exception)."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = _module_aliases(tree, src, package)
        relative = path.relative_to(tests.parent)
        for line, use in sorted(set(_private_uses(tree, aliases, package))):
            if f"{relative}: {use}" not in allowed:
                out.append(f"{relative}:{line}: {use}")
    return out
