"""The layer contract of docs/architecture.md: an import (module level or inside a function) may only run from
a package to its own package or to one on a lower layer. Packages on one layer do not import each other."""

from __future__ import annotations

import ast

import pytest
from helpers import imports
from helpers.imports import ROOT, import_edges, package_modules, private_imports

# Lowest first. Each top-level module or package of src/loraweave sits on exactly one layer.
LAYERS: list[set[str]] = [
    {"errors"},  # the typed errors every layer raises
    {"arguments", "progress", "modes"},  # argument checks, progress bars, the Literal modes
    {"io", "quant", "stack", "report"},  # files; quantized storage; stack math; report records and misses
    {"formats"},  # parsed adapters: keys, alpha, metadata, detection helpers
    {"arch"},  # one declarative module per architecture and their registry
    {"families"},  # family math, merged and runtime side by side
    {"resolve"},  # keys -> modules: the plan
    {"request"},  # what the user asked: specs, prompt syntax, adapter lists
    {"mechanisms"},  # how a change is installed: merge/undo, runtime, sampling, quantized
    {"engine", "streaming"},  # the journal and the handle; streaming's own handle
    {"api"},  # apply, plan
    {"tools"},  # inspect, bake, convert, extract, resize, generate, demo bodies
    {"diffusers", "serve", "comfy"},  # the faces for other programs
    {"cli"},  # the command line
    {"__main__"},  # python -m loraweave
]
# the sub-packages of mechanisms/, lowest first (choose.py picks among all of them)
MECHANISM_LAYERS: list[set[str]] = [
    {"merge"},
    {"quantized"},  # writes into quantized storage; hosted truncations (which runtime's factor cache keeps)
    {"runtime"},
    {"sampling"},
    {"choose"},
]


def _rank(layers: list[set[str]], part: str) -> int:
    ranks = [i for i, layer in enumerate(layers) if part in layer]
    if not ranks:
        raise AssertionError(
            f"{part!r} sits on no layer: add it to the table here and in docs/architecture.md"
        )
    return ranks[0]


def violations(edges: list[tuple[str, str]], layers: list[set[str]], depth: int = 1) -> list[str]:
    """Imports that run upward or sideways between the parts `depth` levels below loraweave."""
    out = []
    for src, dst in edges:
        a, b = src.split("."), dst.split(".")
        if len(a) <= depth or len(b) <= depth or a[:depth] != b[:depth] or a[depth] == b[depth]:
            continue  # the package root itself, another part of the tree, or inside one part
        if _rank(layers, b[depth]) >= _rank(layers, a[depth]):
            out.append(f"{src} -> {dst}")
    return sorted(set(out))


@pytest.fixture(scope="module")
def edges() -> list[tuple[str, str]]:
    modules = package_modules()
    assert len(modules) > 100
    return import_edges(modules)


def test_every_part_has_a_layer():
    parts = {
        p.stem if p.suffix == ".py" else p.name for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()
    }
    parts -= {"__init__", "__pycache__"}
    for part in parts:
        _rank(LAYERS, part)
    for p in (ROOT / "mechanisms").iterdir():
        if p.name not in {"__init__.py", "__pycache__"}:
            _rank(MECHANISM_LAYERS, p.stem)


def test_the_root_stays_small():
    assert len([p for p in ROOT.glob("*.py")]) <= 8


def test_no_import_runs_up_a_layer(edges):
    assert violations(edges, LAYERS) == []


def test_mechanism_subsystems_are_layered(edges):
    inside = [(s, d) for s, d in edges if s.startswith("loraweave.mechanisms.")]
    assert violations(inside, MECHANISM_LAYERS, depth=2) == []


def test_mechanisms_never_name_the_handle():
    """Mechanisms get the state they edit passed in; they neither import engine/ nor name a Handle."""
    for path in (ROOT / "mechanisms").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {
            a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in (*n.args, *n.kwonlyargs)
        }
        assert "Handle" not in names, path
        assert "handle" not in names, path


def test_the_contract_catches_an_upward_import():
    """Negative controls: an upward import, a sideways one, and an unknown part are each refused."""
    edges = [
        ("loraweave.formats.keys", "loraweave.engine.handle"),
        ("loraweave.io.write", "loraweave.quant.gguf"),
    ]
    assert violations(edges, LAYERS) == [
        "loraweave.formats.keys -> loraweave.engine.handle",
        "loraweave.io.write -> loraweave.quant.gguf",
    ]
    assert violations([("loraweave.engine.handle", "loraweave.formats.keys")], LAYERS) == []
    with pytest.raises(AssertionError, match="sits on no layer"):
        violations([("loraweave.novel.x", "loraweave.errors")], LAYERS)


def test_no_private_name_is_imported_from_another_part():
    """Nothing imports another package's private names (`_x`): what a part shares is public in its home
    module."""
    assert private_imports(package_modules()) == []


def test_the_contract_catches_a_private_import(tmp_path, monkeypatch):
    """Negative control: a private name taken across parts (module level and inside a function) is refused;
    one taken inside its own part, a dunder, and another library's private name are not."""
    (tmp_path / "comfy").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "comfy" / "x.py").write_text(
        "from ..tools.remap import _fits, translate\n"
        "from .y import _own\n"
        "from diffusers.loaders.peft import _SET_ADAPTER_SCALE_FN_MAPPING\n"
        "def f():\n    from ..arch.aliases import _bare_parameters\n    from .. import __version__\n"
    )
    (tmp_path / "tools" / "remap.py").write_text("import loraweave.comfy._hidden\n")
    monkeypatch.setattr(imports, "ROOT", tmp_path)
    assert private_imports(imports.package_modules()) == [
        ("loraweave.comfy.x", "loraweave.arch.aliases", "_bare_parameters"),
        ("loraweave.comfy.x", "loraweave.tools.remap", "_fits"),
        ("loraweave.tools.remap", "loraweave.comfy._hidden", "_hidden"),
    ]
