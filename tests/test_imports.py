"""The import graph of orchestrator/ and server/, read from the source with `ast`: no module imports itself back
through others, and the core does not import the HTTP layer.

Every import statement counts wherever it stands (module level, inside a function, under `if TYPE_CHECKING:`):
a lazy import still ties the two modules together. `import a.b` and `from a import b` count as an edge to the
module a.b when it exists, else to the package a (its __init__.py); the implicit import of a module's parent
packages is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("orchestrator", "server")


def module_files(packages: tuple[str, ...] = PACKAGES, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the packages (a package is its __init__)."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imported(name: str, tree: ast.AST, is_package: bool, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (its parsed source `tree`) imports anywhere in its body."""
    out = set()
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import module` reaches the module; `from pkg import name`, pkg's own code
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module, or outside the packages
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `files` it imports."""
    known = set(files)
    return {name: imported(name, ast.parse(path.read_text(), str(path)), path.name == "__init__.py", known)
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: every import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def within(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The part of `graph` between modules of `package`."""
    inside = {m for m in graph if m == package or m.startswith(package + ".")}
    return {m: {d for d in graph[m] if d in inside} for m in inside}


GRAPH = import_graph(module_files())


def test_cycles_finds_a_circle_and_only_circles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_imported_counts_lazy_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import X\n")
    (pkg / "sub" / "leaf.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from ..top import Y\nX = 1\n")
    (pkg / "top.py").write_text("import os\n\ndef f():\n    from .sub import leaf\n    from pkg.sub import X\n")
    graph = import_graph(module_files(("pkg",), tmp_path))
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub.leaf", "pkg.sub"}}
    assert cycles(graph) == [["pkg.sub", "pkg.sub.leaf", "pkg.top"]]


def test_the_graph_reads_every_module():
    assert {"orchestrator.engine", "orchestrator.request", "orchestrator.cache.snapshots", "server.app"} <= set(GRAPH)
    assert "orchestrator.request" in GRAPH["orchestrator.scheduler"]


def test_orchestrator_has_no_import_circle():
    assert cycles(within(GRAPH, "orchestrator")) == []


def test_server_has_no_import_circle():
    assert cycles(within(GRAPH, "server")) == []


def test_no_import_circle_across_the_packages():
    assert [c for c in cycles(GRAPH) if any(m.startswith("orchestrator") for m in c)] == []


def test_the_core_does_not_import_the_http_layer():
    """Only the launcher `python -m orchestrator` (orchestrator/__main__.py) reaches up into server/."""
    up = {m: sorted(d for d in deps if d.split(".")[0] == "server")
          for m, deps in GRAPH.items() if m.startswith("orchestrator") and m != "orchestrator.__main__"}
    assert {m: d for m, d in up.items() if d} == {}
