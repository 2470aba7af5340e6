"""The package's import graph has no cycle: every module-level and function-level import of
``pytest_opprof`` counts, except those under ``if TYPE_CHECKING:`` (issue #41). And no module
imports another module's private (underscore) name: what several modules share is public."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_opprof"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports. ``from pkg import sub`` is an edge to
    ``pkg.sub`` where ``sub`` is a module, else to ``pkg``."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    graph[name].add(target if target in modules else node.module)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names)
        graph[name] = {m for m in graph[name] if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_check_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_plugin_imports_no_stage() -> None:
    """pytest start-up stays light: the plugin module reaches the stages only inside hooks."""
    tree = ast.parse((PACKAGE / "plugin.py").read_text(encoding="utf-8"))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("stages" in ast.unparse(n) or "pipeline" in ast.unparse(n) for n in top)


def private_imports(sources: dict[str, str]) -> list[tuple[str, str, str]]:
    """``(importer, module, name)`` for each ``from <package module> import _name`` in
    ``sources`` (file path relative to the repository -> source text), relative imports
    resolved, at any depth and under ``TYPE_CHECKING`` too. Dunder names (``__version__``) are
    not private; a module's import from itself is not another's."""
    found = []
    for file, text in sources.items():
        parts = Path(file).with_suffix("").parts
        package = list(parts[:-1])
        name = ".".join(package if parts[-1] == "__init__" else parts)
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            if module.split(".")[0] != "pytest_opprof" or module == name:
                continue
            for alias in node.names:
                dunder = alias.name.startswith("__") and alias.name.endswith("__")
                if alias.name.startswith("_") and not dunder:
                    found.append((name, module, alias.name))
    return found


def test_no_module_imports_anothers_private_name() -> None:
    sources = {
        str(path.relative_to(PACKAGE.parent)): path.read_text(encoding="utf-8")
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert len(sources) > 50
    assert private_imports(sources) == []


def test_the_check_sees_a_private_import() -> None:
    sources = {
        "pytest_opprof/passes/a.py": "from pytest_opprof.passes.b import _helper, public\n",
        "pytest_opprof/passes/c.py": "def f():\n    from .b import (\n        _VIEWS,\n    )\n",
        "pytest_opprof/passes/__init__.py": "from .base import _guard\nfrom . import _x\n",
        "pytest_opprof/report/d.py": "from pytest_opprof.report import plots as _plots\n",
        "pytest_opprof/e.py": "from pytest_opprof import __version__\nfrom torch._ops import _F\n",
        "pytest_opprof/f.py": "from pytest_opprof.f import _own\nfrom .passes.b import _out\n",
    }
    assert private_imports(sources) == [
        ("pytest_opprof.passes.a", "pytest_opprof.passes.b", "_helper"),
        ("pytest_opprof.passes.c", "pytest_opprof.passes.b", "_VIEWS"),
        ("pytest_opprof.passes", "pytest_opprof.passes.base", "_guard"),
        ("pytest_opprof.f", "pytest_opprof.passes.b", "_out"),
    ]
