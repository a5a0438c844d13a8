"""Layers point one way: what the front loads, and an import graph of the package without cycles.

The import graph is read statically from each module's source with `ast` (nothing is imported),
so a cycle that only bites in some import order is still seen. What counts as an edge from
module A to module B, both inside `pdserve`:

* `import B`, `from B import x` and `from P import B` (B a submodule of P), relative forms resolved;
* the packages above B (`from pdserve.engine.blocks import x` runs `pdserve/engine/__init__.py`
  first, so A also depends on `pdserve.engine`), except A's own enclosing packages, which are
  already being imported when A runs;
* an import under `if TYPE_CHECKING:` is no edge (it never runs).

Module-level imports (run when A is imported, including those in module-level `try`/`if`) form
the graph that must be acyclic. Imports inside functions run later, on first call; they are
reported separately, and must not close a cycle through the module-level graph either, because
"import it lazily" is how a two-way dependency hides.

The same graph is checked a second time with each subpackage as one node (`pdserve.engine`,
`pdserve.kvtransfer`, … — the layers of the design card; the modules directly in `pdserve/`
stay one node each): two layers must not depend on each other in both directions, even
through different modules.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


def _modules() -> dict[str, Path]:
    """Every module of the installed `pdserve` namespace (package-dir maps the card's folders into it)."""
    out: dict[str, Path] = {}
    for pkg in _packages():
        folder = Path(importlib.util.find_spec(pkg).submodule_search_locations[0])
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def _packages() -> list[str]:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    return tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> tuple[list[ast.stmt], list[ast.stmt]]:
    """(module-level import statements, function-level ones), skipping `if TYPE_CHECKING:` blocks."""
    top: list[ast.stmt] = []
    inner: list[ast.stmt] = []

    def walk(nodes, in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                walk(node.orelse, in_function)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                (inner if in_function else top).append(node)
                continue
            nested = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field, None)
                if isinstance(children, list):
                    walk(children, nested)

    walk(tree.body, False)
    return top, inner


def _targets(stmt: ast.stmt, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that one import statement in `module` makes Python run."""
    names: list[str] = []
    if isinstance(stmt, ast.Import):
        names = [a.name for a in stmt.names]
    else:
        base = stmt.module or ""
        if stmt.level:
            parts = module.split(".")
            anchor = parts if is_package else parts[:-1]
            anchor = anchor[: len(anchor) - (stmt.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in stmt.names]
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    if is_package:
        own.add(module)
    out = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in known and prefix not in own and prefix != module:
                out.add(prefix)
    return out


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level edges, function-level edges) between the package's modules."""
    mods = _modules()
    known = set(mods)
    top_graph: dict[str, set[str]] = {m: set() for m in mods}
    lazy_graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        top, inner = _imports(tree)
        is_pkg = path.name == "__init__.py"
        for stmt in top:
            top_graph[name] |= _targets(stmt, name, is_pkg, known)
        for stmt in inner:
            lazy_graph[name] |= _targets(stmt, name, is_pkg, known)
    return top_graph, lazy_graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as [a, b, …, a], or None."""
    state: dict[str, int] = {}  # 1 = on the path, 2 = done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_the_graph_reader_sees_what_it_must():
    """The reader itself: relative imports, parent packages, function-level imports, TYPE_CHECKING."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "from .b import x\n"
        "from pdserve.engine.blocks import y\n"
        "try:\n    import pdserve.kvtransfer.shm\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    from pdserve.front import server\n"
        "def f():\n    from pdserve.kvtransfer import tcp_send\n"
    )
    known = {"pdserve", "pdserve.a", "pdserve.b", "pdserve.engine", "pdserve.engine.blocks", "pdserve.kvtransfer",
             "pdserve.kvtransfer.shm", "pdserve.kvtransfer.tcp_send", "pdserve.front", "pdserve.front.server"}
    top, inner = _imports(ast.parse(src))
    edges = set().union(*(_targets(s, "pdserve.a", False, known) for s in top))
    lazy = set().union(*(_targets(s, "pdserve.a", False, known) for s in inner))
    assert edges == {"pdserve.b", "pdserve.engine", "pdserve.engine.blocks", "pdserve.kvtransfer",
                     "pdserve.kvtransfer.shm"}
    assert lazy == {"pdserve.kvtransfer", "pdserve.kvtransfer.tcp_send"}
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def _layer(module: str) -> str:
    """The node of `module` in the layer graph: its subpackage, or itself when it sits in `pdserve/`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or f"{module}" in _SUBPACKAGES else module


_SUBPACKAGES = set(_packages()) - {"pdserve"}


def _by_layer(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(_layer(a), set()).update(_layer(b) for b in targets if _layer(b) != _layer(a))
    return out


def _explain(cycle: list[str], top: dict[str, set[str]], lazy: dict[str, set[str]]) -> str:
    """Each hop of a (layer) cycle with the module edges that make it, function-level ones marked."""
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        why = [f"{m} -> {n}{' (function-level)' if n in lazy[m] and n not in top[m] else ''}"
               for m in sorted(top) if _layer(m) == a for n in sorted(top[m] | lazy[m]) if _layer(n) == b]
        hops.append(f"{a} -> {b}: " + ", ".join(why))
    return "\n".join(hops)


@pytest.mark.parametrize("granularity", ["module", "layer"])
def test_the_package_has_no_import_cycle(granularity):
    top, lazy = import_graph()
    assert len(top) > 30, f"found only {len(top)} modules: the graph reader is broken"
    group = _by_layer if granularity == "layer" else (lambda g: g)
    cycle = _find_cycle(group(top))
    assert cycle is None, "module-level import cycle:\n" + _explain(cycle, top, lazy)
    cycle = _find_cycle(group({m: top[m] | lazy[m] for m in top}))
    assert cycle is None, "import cycle closed by a function-level import:\n" + _explain(cycle, top, lazy)


def test_the_leaf_types_import_nothing_of_ours_and_nothing_heavy():
    top, lazy = import_graph()
    assert top["pdserve.basetypes"] == set()
    assert lazy["pdserve.basetypes"] == set()
    assert _loaded_by("import pdserve.basetypes", ["torch", "triton", "transformers", "numpy"]) == []


def test_no_mid_file_imports():
    """Imports stand at a module's top (after its docstring, `__future__` and plain constants), never
    after a definition: a mid-file import is how a cycle hides."""
    offenders = []
    for name, path in _modules().items():
        tree = ast.parse(path.read_text())
        seen_def = None
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                seen_def = seen_def or node.name
            elif seen_def and _imports(ast.Module(body=[node], type_ignores=[]))[0]:
                offenders.append(f"{name}:{node.lineno} (after {seen_def})")
    assert offenders == []


def _loaded_by(statement: str, watch: list[str]) -> list[str]:
    """Which of `watch` (module names or prefixes ending in '.') a fresh interpreter has loaded after `statement`."""
    code = (f"import sys, json\n{statement}\n"
            f"watch = {watch!r}\n"
            "print(json.dumps(sorted(m for m in sys.modules for w in watch"
            " if m == w or (w.endswith('.') and m.startswith(w)))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["pdserve.front.server", "pdserve.kvtransfer.protocol", "pdserve.front.registry"])
def test_the_front_loads_neither_triton_nor_kernels(module):
    """The HTTP front needs pydantic models from the wire protocol, not the verification kernels."""
    assert _loaded_by(f"import {module}", ["triton", "pdserve.kernels", "pdserve.kernels."]) == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


@pytest.mark.parametrize("module, forbidden", [
    # the wire protocol is pydantic models: it needs neither the sampler nor any kernel
    ("pdserve.kvtransfer.protocol", ("pdserve.sampling", "pdserve.kernels")),
    # the block pool addresses blocks by the leaf's hash chain, not through the control plane
    ("pdserve.engine.blocks", ("pdserve.kvtransfer.protocol",)),
    # the transformers runtime is below the engines, which build on it
    ("pdserve.runtime", ("pdserve.engine",)),
])
def test_layers_do_not_reach_up(module, forbidden):
    """What a module may never load, directly or through others, module-level or function-level."""
    top, lazy = import_graph()
    reached = _reachable({m: top[m] | lazy[m] for m in top}, module)
    bad = sorted(m for m in reached for f in forbidden if m == f or m.startswith(f + "."))
    assert bad == []
