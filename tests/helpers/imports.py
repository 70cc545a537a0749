"""The import graph of src/loraweave as the layer and cycle tests read it: every import statement, at module
level or inside a function, is an edge."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "src" / "loraweave"


def module_name(path: Path) -> str:
    parts = ["loraweave", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def import_edges(modules: dict[str, Path]) -> list[tuple[str, str]]:
    """(importer, imported) for every import of a loraweave module."""
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")
                base = base[: len(base) - node.level + 1] if node.level else []
                mod = ".".join([*base, *([node.module] if node.module else [])])
                # `from pkg import sub` imports the submodule; `from mod import name` imports mod
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            else:
                continue
            edges += [(name, t) for t in targets if t.startswith("loraweave") and t != name]
    return edges
