"""The repository root as a ComfyUI custom node (how the registry and ComfyUI-Manager install a pack: a clone
in custom_nodes/). Loaded by ComfyUI's own `nodes.load_custom_node` in a fresh process without
PYTHONPATH, so the entry itself must put the clone's src/ on sys.path; the reference is the pack's NODES
list. A clone named `loraweave` loads too, in both ComfyUI trees, under either module name ComfyUI gives
it, and pytest runs in it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.comfy_env import COMFYUI_TREES, REPO_ROOT
from helpers.comfy_pack import NODE_MODULES

LOAD_REPO_AS_CUSTOM_NODE = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[2])
from helpers.comfy_env import import_comfy
import_comfy()
import nodes
before = "loraweave" in sys.modules
ok = asyncio.run(nodes.load_custom_node(sys.argv[1]))
import loraweave
print(json.dumps({
    "ok": ok,
    "loraweave_before": before,
    "loraweave_file": loraweave.__file__,
    "nodes": {k: v.__module__ for k, v in nodes.NODE_CLASS_MAPPINGS.items() if k.startswith("LoraWeave")},
    "web": nodes.EXTENSION_WEB_DIRS.get("loraweave"),
}))
"""


def test_repository_root_loads_as_a_custom_node():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", LOAD_REPO_AS_CUSTOM_NODE, str(REPO_ROOT), str(REPO_ROOT / "tests")],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT.parent,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ok"] and not got["loraweave_before"], got
    # this clone's source, not another install of loraweave in the environment
    assert Path(got["loraweave_file"]).resolve() == REPO_ROOT / "src" / "loraweave" / "__init__.py"
    assert got["nodes"] == NODE_MODULES
    # [tool.comfy] web, read by ComfyUI's comfy_config parser relative to the clone
    assert got["web"] == str(REPO_ROOT / "src" / "loraweave" / "comfy" / "web")


# A clone named `loraweave` (the repository's name; what ComfyUI-Manager creates). ComfyUI names a custom
# node's module after its full path, but after the folder alone when custom_nodes is given as a relative path
# (and in releases before its full-path names): then this repository's root holds the name `loraweave`.

LOAD_CLONE_AS_CUSTOM_NODE = """
import asyncio, json, os, sys
from pathlib import Path
clone, tests, tree, how = sys.argv[1:5]
sys.path.insert(0, tests)
import helpers.comfy_env as comfy_env
comfy_env.COMFYUI_DIR = Path(tree)  # the same headless recipe for both trees
comfy_env.import_comfy()
import nodes
assert Path(nodes.__file__).parent == Path(tree), nodes.__file__
os.chdir(os.path.dirname(clone))  # custom_nodes/
before = "loraweave" in sys.modules
ok = asyncio.run(nodes.load_custom_node(clone if how == "absolute" else os.path.basename(clone)))
import loraweave
print(json.dumps({
    "ok": ok,
    "loraweave_before": before,
    "loraweave_file": loraweave.__file__,
    "nodes": {k: v.__module__ for k, v in nodes.NODE_CLASS_MAPPINGS.items() if k.startswith("LoraWeave")},
    "web": os.path.abspath(nodes.EXTENSION_WEB_DIRS.get("loraweave", "")),
}))
"""

# Nothing imported at module level (as in most of tests/): pytest imports the root's __init__.py first.
PROBE_TEST = """
def test_the_clone_s_package():
    import loraweave
    from loraweave.comfy.extension import comfy_entrypoint

    assert callable(comfy_entrypoint) and callable(loraweave.apply)
    print("LORAWEAVE_FILE=" + loraweave.__file__)
"""


def _clone_named_loraweave(tmp_path: Path) -> Path:
    """custom_nodes/loraweave with what a clone's import reads: the entry, pyproject.toml ([tool.comfy] web)
    and src/ (copied from this checkout, so the test sees its working tree)."""
    clone = tmp_path / "custom_nodes" / "loraweave"
    clone.mkdir(parents=True)
    for name in ("__init__.py", "pyproject.toml"):
        shutil.copy2(REPO_ROOT / name, clone / name)
    shutil.copytree(REPO_ROOT / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__"))
    return clone


@pytest.mark.parametrize(
    "tree, how, installed",
    [
        ("v0.19.3", "relative", False),
        ("latest", "relative", True),
        ("v0.19.3", "absolute", True),
        ("latest", "absolute", False),
    ],
)
def test_a_clone_named_loraweave_loads_as_a_custom_node(tree, how, installed, tmp_path):
    clone = _clone_named_loraweave(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if installed:  # another loraweave importable by name (as from site-packages): the clone's own still wins
        (tmp_path / "site" / "loraweave").mkdir(parents=True)
        (tmp_path / "site" / "loraweave" / "__init__.py").write_text('"""an installed loraweave"""\n')
        env["PYTHONPATH"] = str(tmp_path / "site")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_CLONE_AS_CUSTOM_NODE,
            str(clone),
            str(REPO_ROOT / "tests"),
            str(COMFYUI_TREES[tree]),
            how,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ok"] and not got["loraweave_before"], (got, run.stderr[-3000:])
    assert Path(got["loraweave_file"]).resolve() == clone / "src" / "loraweave" / "__init__.py"
    assert got["nodes"] == NODE_MODULES
    assert Path(got["web"]).resolve() == clone / "src" / "loraweave" / "comfy" / "web"


def test_pytest_runs_in_a_clone_named_loraweave(tmp_path):
    """pytest imports a root that holds __init__.py under the folder's name before any test in it."""
    clone = _clone_named_loraweave(tmp_path)
    (clone / "tests").mkdir()
    (clone / "tests" / "test_probe.py").write_text(PROBE_TEST)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "tests/test_probe.py"],
        capture_output=True,
        text=True,
        env=env,
        cwd=clone,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 passed" in run.stdout
    found = run.stdout.split("LORAWEAVE_FILE=")[1].split()[0]
    assert Path(found).resolve() == clone / "src" / "loraweave" / "__init__.py"
