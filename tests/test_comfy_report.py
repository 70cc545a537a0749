"""The report each LoraWeave node shows on itself, through ComfyUI's own executor (PromptExecutor in
process, one executor as in a running server, a client id as the browser sends): a re-queue with only the
seed changed reuses the cached node, and the report of that run must still reach the page (an `executed`
message for the node, and the run's /history outputs), as it does on the first run. A changed lora_name runs
the node again and sends the new file's report. The step window's start > end error names only the inputs it
is about."""

from __future__ import annotations

import asyncio
import re
import uuid

import pytest
import torch
from helpers.comfy_env import prompt_executor
from helpers.comfy_home import comfy_home_fixture, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_pack import FLUX_FILE
from helpers.comfy_sampling import StubServer, register_test_nodes
from safetensors.torch import save_file

pytestmark = pytest.mark.usefixtures("one_thread")
NODE = "2"  # the LoraWeave node under test in every prompt
LOADERS = {  # class_type -> its inputs beside model and lora_name
    "LoraWeaveLoader": {"strength_model": 0.8, "strength_clip": 1.0, "mode": "runtime", "strict": False},
    "LoraWeaveLoaderModelOnly": {"strength_model": 0.8, "mode": "merge", "strict": False},
    "LoraWeaveStepWindow": {"strength": 0.8, "start_percent": 0.0, "end_percent": 0.5, "ramp": 0.0},
    "LoraWeaveApplyStack": {"stack_mode": "sum", "block_weights": "", "mode": "runtime"},
}


def sampling_prompt(class_type: str, lora_name: str, seed: int) -> dict:
    """UNETLoader -> the node -> KSampler (1 step, `seed`) -> a capture output node; the node's report goes
    nowhere but to the page."""
    node = {"model": ["1", 0], **LOADERS[class_type]}
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}}
    }
    if class_type == "LoraWeaveApplyStack":
        row = {"lora_name": lora_name, "model_strength": 0.8, "clip_strength": 1.0, "enabled": True}
        prompt["row"] = {"class_type": "LoraWeaveStack", "inputs": row}
        node["lora_stack"] = ["row", 0]
    else:
        node["lora_name"] = lora_name
    sampler = {"model": [NODE, 0], "seed": seed, "steps": 1, "cfg": 1.0, "sampler_name": "euler",
               "scheduler": "simple", "positive": ["pos", 0], "negative": ["neg", 0],
               "latent_image": ["latent", 0], "denoise": 1.0}  # fmt: skip
    return prompt | {
        NODE: {"class_type": class_type, "inputs": node},
        "pos": {"class_type": "LWTestFluxConditioning", "inputs": {"seed": 1}},
        "neg": {"class_type": "LWTestFluxConditioning", "inputs": {"seed": 2}},
        "latent": {"class_type": "LWTestFluxLatent", "inputs": {"size": 2}},
        "sampler": {"class_type": "KSampler", "inputs": sampler},
        "capture": {"class_type": "LWTestCapture", "inputs": {"samples": ["sampler", 0], "tag": "report"}},
    }


def queue(executor, prompt: dict) -> tuple[list[str], dict, list[str]]:
    """Run `prompt` as the server does for a browser client: (the texts of every `executed` message for the
    node, the run's /history outputs, the nodes ComfyUI reported as cached)."""
    import execution

    prompt_id = str(uuid.uuid4())
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    assert valid, f"ComfyUI refused the prompt: {error} {node_errors}"
    executor.server.messages.clear()
    executor.execute(prompt, prompt_id, extra_data={"client_id": "browser"}, execute_outputs=outputs)
    messages = executor.server.messages
    assert executor.success, [data for event, data in messages if event == "execution_error"]
    sent = [
        "\n".join(data["output"]["text"])
        for event, data in messages
        if event == "executed" and data["node"] == NODE and data["output"]
    ]
    (cached,) = [data["nodes"] for event, data in messages if event == "execution_cached"]
    return sent, executor.history_result["outputs"], cached


@pytest.fixture
def executor(comfy_home, monkeypatch):
    register_test_nodes(monkeypatch)
    return prompt_executor(StubServer())


@pytest.mark.parametrize("class_type", list(LOADERS))
def test_a_cached_node_still_sends_its_report(executor, class_type):
    first, history, _ = queue(executor, sampling_prompt(class_type, "flux.safetensors", seed=3))
    assert len(first) == 1 and first[0].startswith("flux.safetensors: ") and "keys_applied=" in first[0]
    assert history[NODE]["text"] == [first[0]]
    again, history, cached = queue(executor, sampling_prompt(class_type, "flux.safetensors", seed=4))
    assert NODE in cached, "the node ran again: the seed alone changed, ComfyUI should reuse it"
    assert again == first, "the reused node sent no report: the page is left without one"
    assert history[NODE]["text"] == first
    changed, history, cached = queue(executor, sampling_prompt(class_type, "partial.safetensors", seed=4))
    assert NODE not in cached and len(changed) == 1
    assert changed[0].startswith("WARNING: partial.safetensors: 6 of 9 keys landed"), changed
    assert history[NODE]["text"] == changed


def test_step_window_range_error_names_only_the_range(comfy_home):
    window = {
        "class_type": "LoraWeaveStepWindow",
        "inputs": {"model": ["1", 0], "lora_name": "flux.safetensors", "strength": 1.0, "ramp": 0.0},
    }
    window["inputs"] |= {"start_percent": 0.8, "end_percent": 0.2}
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}},
        "2": window,
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
    }
    valid, errors, _, _ = run_prompt(prompt)
    assert not valid
    flagged = {e["extra_info"]["input_name"]: e["details"] for e in errors["2"]["errors"]}
    assert set(flagged) == {"start_percent", "end_percent"}, flagged
    assert all("start_percent 0.8 is after end_percent 0.2" in d for d in flagged.values())
    # lora_name is still checked at queue time, by ComfyUI against the files it lists
    window["inputs"] |= {"start_percent": 0.2, "end_percent": 0.6, "lora_name": "missing.safetensors"}
    valid, errors, _, _ = run_prompt(prompt)
    assert not valid and [e["extra_info"]["input_name"] for e in errors["2"]["errors"]] == ["lora_name"]


def flux_single_linear2() -> dict[str, torch.Tensor]:
    """A kohya Flux.1 LoRA on the 38 single blocks' linear2 (5 x 3072 inputs), rank 1: its `down` width alone
    fits no variant; every key landing on the full-size Flux skeleton names flux1."""
    sd = {}
    for i in range(38):
        stem = f"lora_unet_single_blocks_{i}_linear2"
        sd[f"{stem}.lora_down.weight"] = torch.zeros(1, 5 * 3072, dtype=torch.float16)
        sd[f"{stem}.lora_up.weight"] = torch.zeros(3072, 1, dtype=torch.float16)
        sd[f"{stem}.alpha"] = torch.tensor(1.0)
    return sd


def table_rows(text: str) -> dict[str, str]:
    """inspect's table as {row name: value} (the first row of a name; key lines under a row are skipped)."""
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if row := re.match(r"\s*(\S+(?: \S+)*)\s{2,}(\S.*)$", line):
            rows.setdefault(row[1], row[2])
    return rows


def test_inspect_with_a_model_names_the_files_architecture_and_variant(comfy_home, tmp_path):
    """LoraWeave Inspect with a MODEL connected (the tiny Flux): coverage is the MODEL's, but the file is
    described as without one (an SD1 UNet by the shapes that fit, not "unet"; Flux.1 by every key landing on
    its skeleton, not "no known variant"); the file is named as the node names it, and no CLI flag shows."""
    import nodes

    from loraweave.tools.inspect import format_table, inspect_adapter

    loras = comfy_home["base"] / "models" / "loras"
    save_file(flux_single_linear2(), loras / "flux_linear2.safetensors")
    model = nodes.UNETLoader().load_unet(FLUX_FILE, "default")[0]
    inspect = nodes.NODE_CLASS_MAPPINGS["LoraWeaveInspect"]
    rows = {}
    for name in ("sd1.safetensors", "flux_linear2.safetensors"):
        text = inspect.execute(name, model=model).args[0]
        rows[name] = table_rows(text)
        assert rows[name]["file"] == name and str(comfy_home["base"]) not in text, text
        assert "--" not in text and "connected MODEL (flux" in rows[name]["coverage"], text
        # the file part is the CLI's, row for row
        cli = table_rows(format_table(inspect_adapter(loras / name)))
        assert all(cli.get(key) == rows[name].get(key) for key in ("layout", "architecture", "variant")), text
    assert rows["sd1.safetensors"]["architecture"] == "sd1", rows
    variant = rows["flux_linear2.safetensors"]["variant"]
    assert variant.startswith("flux1 (dev, schnell, Fill, Kontext) (file: 38 single blocks"), variant
    flux_text = inspect.execute("flux_linear2.safetensors", model=model).args[0]
    assert "... 94 more" in flux_text and flux_text.splitlines()[-1].strip() == "... 94 more", flux_text
