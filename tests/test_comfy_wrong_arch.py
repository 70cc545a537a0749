"""A file for another architecture through ComfyUI's own executor (issue 43 B/E): the real SD2 file
`JustinJiangNext__lora-2.0` on ComfyUI's SD1.5 model (full size, on `meta`) landed 192 of its 256 keys with
one quiet warning. Every loading node now stops with WrongArchitectureError saying "an SD2 LoRA on an SD1.5
model" and naming its own opt-in, the `allow_other_arch` input; with it on, the file is applied and the node's
report, the summary and a WARNING say so. The real files of the model's own architecture (LoRA, LoKr,
cloneofsimo) and the Flux file on Flux dev and schnell are not refused; a file no key of which lands still
gets the empty refusal, without an allow_empty option the pack does not have."""

from __future__ import annotations

import logging

import pytest
from conftest import REALDATA
from helpers.comfy_env import import_comfy
from helpers.comfy_full import FLUX_DEV, SD2_UNET, SD15_UNET, meta_patcher
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_pack import FLUX_FILE
from helpers.comfy_sampling import REGISTRY, register_test_nodes

SD2_FILE = "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"
FLUX_REAL = "leighwoods__public-loras__lora.safetensors"
SD1_FILES = (
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors",
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors",
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors",
    "cloneofsimo__lora__analog_svd_rank4.safetensors",
    "timohavdk__sd-lora__2100-lora.safetensors",
)
MERGE = {"mode": "merge", "strict": False}
NODES = {  # node -> (its inputs besides model and lora_name, the report's output slot)
    "LoraWeaveLoader": ({"strength_model": 1.0, "strength_clip": 1.0, **MERGE}, 2),
    "LoraWeaveLoaderModelOnly": ({"strength_model": 1.0, **MERGE}, 1),
    "LoraWeaveStepWindow": ({"strength": 1.0, "start_percent": 0.0, "end_percent": 1.0, "ramp": 0.0}, 1),
    "LoraWeaveApplyStack": ({"stack_mode": "sum", "block_weights": "", "mode": "merge"}, 2),
    "LoraWeaveMultiLoader": ({"mode": "merge"}, 2),
}
SAYS = f"{SD2_FILE}: an SD2 LoRA on an SD1.5 model"


@pytest.fixture(scope="module")
def models(comfy_home, realdata):
    """ComfyUI's own full-size models on `meta`, and the real files in a loras folder of ComfyUI's."""
    import folder_paths

    c = import_comfy()
    folder = str(realdata / "lora")
    folder_paths.add_model_folder_path("loras", folder)
    yield {
        "sd15": meta_patcher(c.supported_models.SD15, SD15_UNET),
        "sd2": meta_patcher(c.supported_models.SD20, SD2_UNET),
        "flux": meta_patcher(c.supported_models.Flux, FLUX_DEV),
        "flux-schnell": meta_patcher(c.supported_models.FluxSchnell, FLUX_DEV),
    }
    folder_paths.folder_names_and_paths["loras"][0].remove(folder)


def _graph(node: str, lora: str, model: str, **extra) -> dict:
    inputs, slot = NODES[node]
    prompt = {
        "1": {"class_type": "LWTestModelSource", "inputs": {"name": model}},
        "2": {"class_type": node, "inputs": {"model": ["1", 0], **inputs, **extra}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", slot]}},
    }
    if node == "LoraWeaveMultiLoader":  # one row, in the API format the frontend sends
        row = {"loras.on_1": True, "loras.lora_1": lora, "loras.strength_model_1": 1.0}
        prompt["2"]["inputs"] |= {"loras": "1", **row, "loras.strength_clip_1": 1.0}
    elif node == "LoraWeaveApplyStack":
        row = {"lora_name": lora, "model_strength": 1.0, "clip_strength": 1.0, "enabled": True}
        prompt["4"] = {"class_type": "LoraWeaveStack", "inputs": row}
        prompt["2"]["inputs"]["lora_stack"] = ["4", 0]
    else:
        prompt["2"]["inputs"]["lora_name"] = lora
    return prompt


def _run(monkeypatch, models, prompt: dict, model: str):
    register_test_nodes(monkeypatch)
    monkeypatch.setitem(REGISTRY, model, models[model])
    return run_prompt(prompt)


@pytest.mark.parametrize("node", list(NODES))
def test_the_sd2_file_on_comfy_sd15_is_refused_by_every_loader(models, monkeypatch, node):
    valid, errors, ex, _ = _run(monkeypatch, models, _graph(node, SD2_FILE, "sd15"), "sd15")
    assert valid and not ex.success, errors
    failure = execution_error(ex)
    assert failure["node_id"] == "2", failure
    assert failure["exception_type"] == "loraweave.errors.WrongArchitectureError", failure
    message = failure["exception_message"]
    assert SAYS in message and "turn on this node's allow_other_arch to apply it anyway" in message, message
    assert "allow_empty" not in message and "allow_other_arch=True" not in message, message
    assert models["sd15"].patches == {}


@pytest.mark.parametrize("node", ["LoraWeaveLoader", "LoraWeaveLoaderModelOnly", "LoraWeaveApplyStack"])
def test_the_opt_in_applies_it_and_the_node_says_so(models, monkeypatch, caplog, node):
    prompt = _graph(node, SD2_FILE, "sd15", allow_other_arch=True)
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        valid, errors, ex, out = _run(monkeypatch, models, prompt, "sd15")
    assert valid and ex.success, errors or execution_error(ex)
    text = out["2"][NODES[node][1]]
    assert text.splitlines()[0] == f"WARNING: {SAYS}, applied anyway (allow_other_arch)", text
    assert "other_arch=sd2_on_sd1" in text and "keys_applied=192/256" in text, text
    assert "loraweave other_arch" in caplog.text and "an SD2 LoRA on an SD1.5 model" in caplog.text
    assert len(out["2"][0].patches) == 96  # the 96 modules whose shapes fit: attn2.to_k/to_v miss
    assert models["sd15"].patches == {}


@pytest.mark.parametrize(
    "lora, model",
    [
        *((name, "sd15") for name in SD1_FILES),
        (SD2_FILE, "sd2"),
        (FLUX_REAL, "flux"),
        (FLUX_REAL, "flux-schnell"),
    ],
)
def test_files_of_the_models_own_architecture_are_not_refused(models, monkeypatch, lora, model):
    prompt = _graph("LoraWeaveLoaderModelOnly", lora, model)
    valid, errors, ex, out = _run(monkeypatch, models, prompt, model)
    assert valid and ex.success, errors or execution_error(ex)
    text = out["2"][1]
    assert "other_arch" not in text and "keys_applied=0/" not in text, text


def test_a_file_nothing_lands_of_names_no_option_the_pack_lacks(comfy_home):
    """sd1.safetensors (one UNet proj_in key, no width that names a release) on the tiny Flux: the empty
    refusal, which no longer tells a ComfyUI user to pass allow_empty=True."""
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}},
        "2": {
            "class_type": "LoraWeaveLoaderModelOnly",
            "inputs": {"model": ["1", 0], "lora_name": "sd1.safetensors", "strength_model": 1.0, **MERGE},
        },
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
    }
    valid, errors, ex, _ = run_prompt(prompt)
    assert valid and not ex.success, errors
    failure = execution_error(ex)
    assert failure["exception_type"] == "loraweave.errors.NoKeysLandedError", failure
    message = failure["exception_message"]
    assert message.startswith("sd1.safetensors: no key landed") and "allow_empty" not in message, message
    assert REALDATA.is_dir()
