"""The pack installed twice in one ComfyUI: the `loraweave comfy install` shim and a clone of this repository
side by side in custom_nodes, loaded by ComfyUI's own `nodes.load_custom_node` in a fresh process. The
log must say so once, naming both folders; one install alone (the shim, or the clone, which ComfyUI serves
under two names) says nothing. The browser side (the web script registers once): test_comfy_browser.py."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.comfy_env import REPO_ROOT
from helpers.comfy_pack import NODE_IDS
from helpers.comfy_page_runs import install_shim

LOAD = """
import asyncio, json, logging, sys
sys.path.insert(0, sys.argv[1])
from helpers.comfy_env import import_comfy
import_comfy()
import nodes
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("loraweave").addHandler(Keep())
loaded = [asyncio.run(nodes.load_custom_node(folder)) for folder in sys.argv[2:]]
print(json.dumps({"loaded": loaded, "twice": [m for m in said if "pack_installed_twice" in m],
                  "nodes": sorted(k for k in nodes.NODE_CLASS_MAPPINGS if k.startswith("LoraWeave"))}))
"""


def load(*folders) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", LOAD, str(REPO_ROOT / "tests"), *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def shim_in(base) -> str:
    return str(install_shim(base))


def test_shim_and_clone_together_are_said_once(tmp_path):
    shim = shim_in(tmp_path / "a")
    clone = tmp_path / "a" / "custom_nodes" / "ComfyUI-LoraWeave"  # beside the shim
    clone.symlink_to(REPO_ROOT, target_is_directory=True)
    other_shim = shim_in(tmp_path / "b")  # the same shim folder name again: no new install, nothing new said
    got = load(shim, clone, other_shim)
    assert got["loaded"] == [True, True, True] and len(got["nodes"]) == len(NODE_IDS), got
    (said,) = got["twice"]
    assert f"folders={clone}," in said or f",{clone}" in said, said
    assert shim in said and "loraweave comfy uninstall" in said, said


def test_one_install_says_nothing(tmp_path):
    clone = tmp_path / "ComfyUI-LoraWeave"
    clone.symlink_to(REPO_ROOT, target_is_directory=True)
    assert load(clone)["twice"] == [] and load(shim_in(tmp_path / "a"))["twice"] == []
