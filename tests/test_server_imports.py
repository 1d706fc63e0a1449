"""server/'s import graph, read with `ast`: no cycle, the layers in order (validation and field policy below the
protocols, the protocols below the driver and the docs, the app on top), and no protocol reaching into another's
private names."""

from __future__ import annotations

import ast
from pathlib import Path

SERVER = Path(__file__).resolve().parent.parent / "server"

# module -> the server modules it may import (nothing else of server/)
LAYERS = {
    "server.fields": set(),
    "server.errors": set(),
    "server.logprobs": set(),
    "server.metrics": set(),
    "server.validate": set(),
    "server.conversation": {"server.validate"},
    "server.protocols": set(),
    "server.protocols.base": {"server.validate"},
    "server.protocols.context_edits": {"server.validate"},
    "server.protocols.openai": {"server.fields", "server.errors", "server.validate", "server.protocols.base"},
}
LOW = {"server.fields", "server.errors", "server.logprobs", "server.validate", "server.conversation",
       "server.protocols.base", "server.protocols.context_edits", "server.protocols.openai"}


def _module(path: Path) -> str:
    parts = path.relative_to(SERVER.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(server module imported, names imported from it) for every import of `path`, relative ones resolved."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names if a.name.startswith("server")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if not base.startswith("server"):
                continue
            names = [a.name for a in node.names]
            modules = {f"{base}.{n}" for n in names} & set(GRAPH_NODES)
            out += [(m, []) for m in modules] or [(base, names)]
    return out


GRAPH_NODES = [_module(p) for p in SERVER.rglob("*.py")]


def _graph() -> dict[str, set[str]]:
    return {_module(p): {m for m, _ in _imports(p) if m != _module(p)} for p in SERVER.rglob("*.py")}


def test_server_has_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]) \
                if nxt in path else f"import cycle through {nxt}"
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_lower_layers_import_only_below_them():
    graph = _graph()
    for module, allowed in LAYERS.items():
        assert graph[module] <= allowed, f"{module} imports {sorted(graph[module] - allowed)}"
    for module, imported in graph.items():
        if module.startswith("server.protocols."):
            assert not imported & {"server.app", "server.driver", "server.docs"}, module
        if module in LOW:
            assert "server.app" not in imported and "server.driver" not in imported, module


def test_no_module_imports_a_private_name_of_another():
    for path in SERVER.rglob("*.py"):
        for module, names in _imports(path):
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{_module(path)} imports {private} from {module}"
