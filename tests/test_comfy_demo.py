"""`loraweave comfy demo DIR`: the pack tried without a real checkpoint. The tiny Flux has exactly the tensors
of ComfyUI's own Flux class at those widths; the written workflow runs through ComfyUI's own
validate_prompt and PromptExecutor in a fresh process that finds the files only through the written
extra_model_paths.yaml (ComfyUI's own parser) and loads the pack from this checkout's clone entry; every
merged weight equals W + alpha/rank * up @ down (fp64) of the written files. The README says how."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from helpers.comfy_env import REPO_ROOT
from helpers.comfy_models import flux_state_dict
from safetensors.torch import load_file

from loraweave.cli import main

RUN_DEMO_WORKFLOW = """
import asyncio, json, sys
from pathlib import Path
demo, tests, repo = sys.argv[1:4]
sys.path.insert(0, tests)
from helpers.comfy_env import COMFYUI_DIR, import_comfy
import_comfy()
from utils.extra_config import load_extra_path_config  # before nodes puts ComfyUI/comfy (its utils.py) first
import nodes
load_extra_path_config(str(Path(demo) / "extra_model_paths.yaml"))
assert asyncio.run(nodes.load_custom_node(repo))
preview = str(COMFYUI_DIR / "comfy_extras" / "nodes_preview_any.py")
assert asyncio.run(nodes.load_custom_node(preview, module_parent="comfy_extras"))
from helpers.comfy_home import run_prompt
prompt = json.loads((Path(demo) / "loraweave_demo_workflow.json").read_text())
valid, errors, ex, out = run_prompt(prompt, ("2", "3", "4"))
assert valid, errors
assert all(v is not None for v in out.values()), out
patcher = out["2"][0]
patcher.patch_model()
weights = {k: v.detach().double() for k, v in patcher.model.diffusion_model.state_dict().items()}
torch = __import__("torch")
torch.save(weights, Path(demo) / "merged.pt")
print(json.dumps({"model": type(patcher.model.model_config).__name__, "loader": out["2"][1],
                  "preview": out["3"][0], "inspect": out["4"][0], "triggers": out["4"][1]}))
"""


def test_the_tiny_flux_has_the_tensors_of_comfyui_s_flux():
    from loraweave.comfy.demo import tiny_flux

    ours = {k: tuple(v.shape) for k, v in tiny_flux().items()}
    assert ours == {k: tuple(v.shape) for k, v in flux_state_dict().items()}


def test_the_demo_workflow_runs_in_comfyui_without_a_checkpoint(tmp_path, capsys):
    demo = tmp_path / "try"
    assert main(["comfy", "demo", str(demo), "--json"]) == 0
    files = json.loads(capsys.readouterr().out)
    assert main(["comfy", "demo", str(demo)]) == 2  # its own files are never replaced without --force
    assert main(["comfy", "demo", str(demo), "--force"]) == 0
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run(
        [sys.executable, "-c", RUN_DEMO_WORKFLOW, str(demo), str(REPO_ROOT / "tests"), str(REPO_ROOT)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["model"] == "Flux"
    assert got["preview"] == got["loader"]
    assert "lwdemo" in got["triggers"]
    lora = load_file(files["lora"])
    base = load_file(files["model"])
    merged = torch.load(demo / "merged.pt")
    # kohya's names: lora_unet_ + the module's name with dots as underscores
    targets = {
        "lora_unet_" + key.removesuffix(".weight").replace(".", "_"): key
        for key, w in base.items()
        if key.startswith(("double_blocks.", "single_blocks.")) and w.dim() == 2
    }
    assert sorted(targets) == sorted({k.split(".")[0] for k in lora}) and len(targets) == 13
    assert "39/39" in got["loader"], got["loader"]  # keys: down, up and alpha of 13 modules
    for stem, key in targets.items():
        up = lora[f"{stem}.lora_up.weight"].double()
        down = lora[f"{stem}.lora_down.weight"].double()
        expected = base[key].double() + float(lora[f"{stem}.alpha"]) / down.shape[0] * (up @ down)
        torch.testing.assert_close(merged[key], expected, rtol=0, atol=1e-6)


def test_the_readme_says_how_to_set_up_comfyui_and_try_the_pack():
    from loraweave.comfy.demo import WORKFLOW_FILE, YAML_FILE

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme[readme.index("\n## ComfyUI") : readme.index("\n## Support matrix")]
    assert "pip install -r requirements.txt" in section  # ComfyUI's own requirements, in its checkout
    assert "loraweave comfy demo ~/loraweave-demo\n" in section
    assert f"python main.py --cpu --extra-model-paths-config ~/loraweave-demo/{YAML_FILE}\n" in section
    assert f"~/loraweave-demo/{WORKFLOW_FILE}" in section
