"""No import cycles between the modules of ``streamgrpo``, checked on the source (nothing is imported).

Every module under ``streamgrpo/`` is parsed with :mod:`ast`. Every import of one of the package's
modules is an edge of the graph: ``import streamgrpo.x``, ``from streamgrpo.x import y`` (to the
submodule ``streamgrpo.x.y`` when there is one) and relative imports (``from .x import y``, ``from ..
import z``), and the parent packages each initialises first (``from a.b.c import x`` runs
``a/b/__init__.py`` before ``c``), wherever it stands: at module level, inside a function, or under ``if TYPE_CHECKING:``.
An import inside a function cannot fail at import time, but two modules that call each other are
one concept cut in two all the same (a real call cycle hides there), and a type-only import is a
dependency of the design; so both count. Such deferred imports are still marked (``python
tests/unit/repo/test_import_cycles.py`` lists them): the package defers heavy imports (torch models,
transformers, Redis) into the functions that need them. Cycles are the strongly connected
components of the graph (Tarjan) with more than one module, or a module importing itself.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.paths import REPO


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module of the package
    line: int
    deferred: bool  # inside a function or under `if TYPE_CHECKING:`


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``root/package`` (``__init__`` = the package)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(nodes: list[ast.AST], deferred: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement under ``nodes`` with whether it runs later than the module's import."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, deferred
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from _import_nodes(list(ast.iter_child_nodes(node)), True)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.body, True)
            yield from _import_nodes(node.orelse, deferred)
        else:
            yield from _import_nodes(list(ast.iter_child_nodes(node)), deferred)


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a module of the package (None: not the package's)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: from the module's own package, one level up per extra dot
            package = module.split(".") if modules[module].name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[: len(package) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" for alias in node.names]  # a submodule, else resolves to base
    return list(dict.fromkeys(t for t in (_known(n, modules) for n in names) if t is not None))  # once each


def _with_parents(target: str, source: str, modules: dict[str, Path]) -> list[str]:
    """``target`` and the packages Python initialises before it (``import a.b.c`` runs ``a/__init__``,
    then ``a/b/__init__``), less those already initialised before ``source`` runs (its own parents)."""
    parts = target.split(".")
    parents = [".".join(parts[:k]) for k in range(1, len(parts))]
    mine = {".".join(source.split(".")[:k]) for k in range(1, len(source.split(".")) + 1)}
    return [p for p in parents if p in modules and p not in mine] + [target]


def package_imports(root: Path, package: str) -> list[Import]:
    """Every import of one of the package's modules by another (or the same), in file order, with the
    parent packages each one initialises first."""
    modules = package_modules(root, package)
    out = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node, deferred in _import_nodes(tree.body, False):
            targets = [m for t in _targets(node, module, modules) for m in _with_parents(t, module, modules)]
            out += [Import(module, t, node.lineno, deferred) for t in dict.fromkeys(targets)]
    return out


def import_graph(imports: list[Import]) -> dict[str, set[str]]:
    """Module -> the modules it imports, at module level or deferred."""
    graph: dict[str, set[str]] = {}
    for imp in imports:
        graph.setdefault(imp.source, set())
        graph.setdefault(imp.target, set())
        graph[imp.source].add(imp.target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: strongly connected components (Tarjan) of two or more modules, or of one
    module that imports itself; each sorted, the list sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def _describe(cycles: list[list[str]], imports: list[Import]) -> str:
    lines = []
    for cycle in cycles:
        lines.append("cycle among " + ", ".join(cycle))
        members = set(cycle)
        lines += [f"    {i.source} imports {i.target} (line {i.line}{', deferred' if i.deferred else ''})"
                  for i in imports if i.source in members and i.target in members]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- streamgrpo
def test_streamgrpo_has_no_import_cycle():
    imports = package_imports(REPO, "streamgrpo")
    graph = import_graph(imports)
    assert "streamgrpo.learner.trainer" in graph["streamgrpo.learner.loop"]  # the graph is really built
    assert len(graph) >= 50
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (move what both modules need to the lower one):\n" + \
        _describe(cycles, imports)


def test_function_level_imports_are_listed_and_name_real_modules():
    deferred = [i for i in package_imports(REPO, "streamgrpo") if i.deferred]
    assert deferred  # the package defers heavy imports (torch models, transformers, Redis) into functions
    modules = package_modules(REPO, "streamgrpo")
    assert all(i.target in modules for i in deferred)


# ------------------------------------------------------------------------------ a synthetic package
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"pkg/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _cycles(root: Path) -> list[list[str]]:
    return find_cycles(import_graph(package_imports(root, "pkg")))


def test_a_relative_two_module_cycle_is_found(tmp_path):
    root = _package(tmp_path, {"pkg/a.py": "from . import b\n", "pkg/b.py": "from .a import thing\n"})
    assert _cycles(root) == [["pkg.a", "pkg.b"]]


def test_an_absolute_cycle_through_a_subpackage_is_found(tmp_path):
    root = _package(tmp_path, {
        "pkg/a.py": "from pkg.sub import c\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "import pkg.sub.d as d\n",
        "pkg/sub/d.py": "try:\n    from ..a import x\nexcept ImportError:\n    x = None\n",
        "pkg/e.py": "import os\nfrom pkg.a import y\n",  # imports into the cycle, not part of it
    })
    assert _cycles(root) == [["pkg.a", "pkg.sub.c", "pkg.sub.d"]]


def test_a_package_init_and_a_self_import(tmp_path):
    root = _package(tmp_path, {"pkg/__init__.py": "from .m import f\n", "pkg/m.py": "from pkg import VERSION\n",
                               "pkg/s.py": "from pkg import s\n"})
    assert _cycles(root) == [["pkg", "pkg.m"], ["pkg.s"]]


def test_function_level_and_type_checking_imports_make_cycles_too(tmp_path):
    root = _package(tmp_path, {
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
                     "def f():\n    from pkg.a import g\n    return g\n"
                     "class C:\n    def m(self):\n        import pkg.a\n"),
        "pkg/c.py": "def f():\n    from pkg.d import g\n",  # a call cycle that only functions hold
        "pkg/d.py": "def g():\n    from pkg import c\n",
        "pkg/e.py": "def f():\n    from pkg import a\n",  # deferred, but one way: no cycle
    })
    assert _cycles(root) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    deferred = [(i.source, i.target, i.line) for i in package_imports(root, "pkg") if i.deferred]
    assert deferred == [("pkg.b", "pkg.a", 3), ("pkg.b", "pkg.a", 5), ("pkg.b", "pkg.a", 9), ("pkg.c", "pkg.d", 2),
                        ("pkg.d", "pkg.c", 2), ("pkg.e", "pkg.a", 2)]


def test_a_cycle_through_a_parent_packages_init_is_found(tmp_path):
    """``from pkg.config.base import S`` runs ``pkg/config/__init__.py`` first; when that init loads a
    schema that imports the module back, importing the module first fails (a partially initialised
    module): the shape of recipes/demo/config.py -> config.base once."""
    root = _package(tmp_path, {
        "pkg/config/__init__.py": "from pkg.config.schema import Config\n",
        "pkg/config/base.py": "class S: ...\n",
        "pkg/config/schema.py": "from pkg.recipe import R\nclass Config: ...\n",
        "pkg/recipe.py": "from pkg.config.base import S\nclass R(S): ...\n",
        "pkg/config/data.py": "from pkg.config.base import S\n",  # inside the package: its init already ran
    })
    assert _cycles(root) == [["pkg.config", "pkg.config.schema", "pkg.recipe"]]


def test_the_two_cycles_this_test_once_missed_are_found_in_their_old_shape(tmp_path):
    """config/budget.py <-> config/schema.py (a TYPE_CHECKING import one way, a function-level one back)
    and recipes/demo/assets.py -> warm.warm_format -> assets.prepare_data (function-level both ways)."""
    root = _package(tmp_path, {
        "pkg/budget.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.schema import Config\n",
        "pkg/schema.py": "class Config:\n    def advice(self):\n        from pkg.budget import held_bytes\n",
        "pkg/assets.py": "def prepare_model():\n    from pkg.warm import warm_format\n",
        "pkg/warm.py": "def warm_format():\n    from pkg.assets import prepare_data\n",
    })
    assert _cycles(root) == [["pkg.assets", "pkg.warm"], ["pkg.budget", "pkg.schema"]]


if __name__ == "__main__":  # the graph's cycles and the function-level imports, for a reader
    found = package_imports(REPO, "streamgrpo")
    cycles = find_cycles(import_graph(found))
    print(_describe(cycles, found) if cycles else "no import cycles")
    print("\nfunction-level (or TYPE_CHECKING) imports inside streamgrpo:")
    for imp in found:
        if imp.deferred:
            print(f"  {imp.source}:{imp.line} -> {imp.target}")
    sys.exit(1 if cycles else 0)
