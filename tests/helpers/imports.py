"""The import graph of src/loraweave as the layer and cycle tests read it: every import statement, at module
level or inside a function, is an edge."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "loraweave"


def module_name(path: Path) -> str:
    parts = ["loraweave", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(modules: dict[str, Path]) -> Iterator[tuple[str, str, list[str]]]:
    """(importer, imported module, names it takes) for every import statement (`import x` takes none)."""
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield name, alias.name, []
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                mod = ".".join([*base, *([node.module] if node.module else [])])
                yield name, mod, [a.name for a in node.names]


def import_edges(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a loraweave module."""
    edges = []
    for name, mod, names in _imports(modules):
        # `from pkg import sub` imports the submodule; `from mod import name` imports mod
        targets = [f"{mod}.{n}" if f"{mod}.{n}" in modules else mod for n in names] if names else [mod]
        edges += [(name, t) for t in targets if t.startswith("loraweave") and t != name]
    return edges


def private_imports(modules: dict[str, Path]) -> list[tuple[str, str, str]]:
    """(importer, module, name) for every private name (`_x`, not a dunder) a module imports from a loraweave
    module of another top-level part (`from ..arch.aliases import _x` in comfy/), or a private module it
    reaches that way (`import loraweave.tools._x`)."""
    out = []
    for name, mod, names in _imports(modules):
        if mod.split(".")[0] != "loraweave" or (len(mod.split(".")) > 1 and _part(mod) == _part(name)):
            continue  # another library, or inside one part
        taken = [n for n in names if _private(n)]
        taken += [p for p in mod.split(".") if _private(p)]
        out += [(name, mod, n) for n in taken]
    return sorted(set(out))


def _part(module: str) -> str:
    """The top-level part of a loraweave module (`loraweave.arch.aliases` -> `arch`; the root: "")."""
    return (module.split(".") + [""])[1]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")
