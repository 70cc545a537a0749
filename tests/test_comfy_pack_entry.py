"""The repository root as a ComfyUI custom node (how the registry and ComfyUI-Manager install a pack: a clone
in custom_nodes/). Loaded by ComfyUI v0.19.3's own `nodes.load_custom_node` in a fresh process without
PYTHONPATH, so the entry itself must put the clone's src/ on sys.path; the reference is the pack's NODES
list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.comfy_env import REPO_ROOT
from helpers.comfy_pack import NODE_IDS

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
    modules = {"LoraWeaveMultiLoader": "loraweave.comfy.multi_loader"}  # the others: comfy/nodes.py
    assert got["nodes"] == {n: modules.get(n, "loraweave.comfy.nodes") for n in NODE_IDS}
    # [tool.comfy] web, read by ComfyUI's comfy_config parser relative to the clone
    assert got["web"] == str(REPO_ROOT / "src" / "loraweave" / "comfy" / "web")
