"""Imports run one way, down: workers and the engine never import the HTTP server, and no two
modules import each other (directly or round a longer loop)."""

from __future__ import annotations

import ast
from pathlib import Path

import minisgl

ROOT = Path(minisgl.__file__).parent
BELOW_SERVER = ("engine", "tokenizer", "scheduler", "kvcache", "layers", "models", "message")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Every minisgl module -> the minisgl modules it imports (at any depth of its code)."""
    modules = {_module(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _below_server(module: str) -> bool:
    parts = module.split(".")
    return module == "minisgl.process" or (len(parts) > 1 and parts[1] in BELOW_SERVER)


def test_nothing_below_the_server_imports_it() -> None:
    bad = [
        f"{m} -> {d}"
        for m, deps in _graph().items()
        if _below_server(m)
        for d in deps
        if d.startswith("minisgl.server")
    ]
    assert not bad, bad


def test_no_import_cycles() -> None:
    graph = _graph()
    # A package's __init__ naming its own modules is not a cycle through them.
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".") and not d.startswith(m + ".")}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d) :] + [d])
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, [" -> ".join(c) for c in cycles]
