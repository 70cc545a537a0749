"""The real ComfyUI with the pack installed the way users install it, and a prompt runner: what the
node tests share. `comfy_home` (a module fixture: import it by name) makes a temp base holding loras/
(helpers/ comfy_pack.write_loras) and diffusion_models/ (the tiny Flux), runs `loraweave comfy install
--base-directory`, and loads the shim with ComfyUI's own custom-node loader; `run_prompt` runs ComfyUI's
validate_prompt and PromptExecutor on an API-format prompt."""

from __future__ import annotations

import asyncio

import pytest
from safetensors.torch import save_file

from .comfy_env import COMFYUI_DIR, import_comfy, prompt_executor
from .comfy_models import flux_state_dict
from .comfy_pack import FLUX_FILE, write_loras


class _Server:
    """What PromptExecutor needs of ComfyUI's PromptServer."""

    client_id = None
    last_node_id = None
    last_prompt_id = None

    def send_sync(self, event, data, sid=None) -> None:
        pass


@pytest.fixture(scope="module", name="comfy_home")
def comfy_home_fixture(tmp_path_factory):
    """ComfyUI with a temp base holding loras/ and diffusion_models/, and our pack loaded from the installed
    shim."""
    import_comfy()
    import folder_paths
    import nodes

    from loraweave.cli import main as cli_main

    base = tmp_path_factory.mktemp("comfy_base")
    loras = write_loras(base / "models" / "loras")
    (base / "models" / "diffusion_models").mkdir(parents=True)
    save_file(flux_state_dict(), base / "models" / "diffusion_models" / FLUX_FILE)
    folder_paths.add_model_folder_path("loras", str(base / "models" / "loras"))
    folder_paths.add_model_folder_path("diffusion_models", str(base / "models" / "diffusion_models"))
    assert cli_main(["comfy", "install", str(COMFYUI_DIR), "--base-directory", str(base)]) == 0
    shim = base / "custom_nodes" / "loraweave_nodes"
    assert asyncio.run(nodes.load_custom_node(str(shim)))
    preview = COMFYUI_DIR / "comfy_extras" / "nodes_preview_any.py"
    assert asyncio.run(nodes.load_custom_node(str(preview), module_parent="comfy_extras"))
    return {"base": base, "loras": loras, "shim": shim}


def run_prompt(prompt: dict, node_ids: tuple[str, ...] = ("1", "2")):
    """(valid, node_errors, executor, cached outputs of `node_ids`) after ComfyUI validates and executes the
    prompt (a node's `report_slot` key is the test's own and is dropped)."""
    import execution

    valid, _, outputs, node_errors = asyncio.run(execution.validate_prompt("t", prompt, None))
    if not valid:
        return False, node_errors, None, {}
    ex = prompt_executor(_Server())
    ex.execute(
        {k: {key: v for key, v in n.items() if key != "report_slot"} for k, n in prompt.items()},
        "t",
        {},
        outputs,
    )

    def cached(node_id):
        entry = asyncio.run(ex.caches.outputs.get(node_id))
        return None if entry is None else [value[0] for value in entry.outputs]

    return True, {}, ex, {node_id: cached(node_id) for node_id in node_ids}


def execution_error(ex) -> dict:
    """The `execution_error` message ComfyUI sent for a failed run (node_id, exception_type, message, ...)."""
    return next(data for event, data in ex.status_messages if event == "execution_error")
