"""No import cycle in src/loraweave: every import statement (module level or inside a function) is an edge."""

from __future__ import annotations

from helpers.imports import import_edges, package_modules


def _edges(modules: dict) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for src, dst in import_edges(modules):
        if dst in modules:
            graph[src].add(dst)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_walker_sees_a_cycle():
    """Negative control: a two-module cycle through a function-level import is found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]


def test_no_import_cycles():
    modules = package_modules()
    assert len(modules) > 50
    assert _cycles(_edges(modules)) == []
