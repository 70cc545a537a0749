"""What the node-pack tests share: the files a ComfyUI user would have (a tiny Flux checkpoint in
diffusion_models, kohya LoRA files for it and for the wrong architecture, a broken one), a fake ComfyUI folder
for install/uninstall, and the fp64 reference of a kohya LoRA's merged weight."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

FLUX_FILE = "tiny_flux.safetensors"
# The pack's nodes, as ComfyUI registers them.
NODE_IDS = frozenset(
    {
        "LoraWeaveLoader",
        "LoraWeaveLoaderModelOnly",
        "LoraWeaveStack",
        "LoraWeaveApplyStack",
        "LoraWeaveStepWindow",
        "LoraWeaveInspect",
        "LoraWeaveMultiLoader",
        "LoraWeaveConditioningLoRA",
        "LoraWeaveConditioningTextEncode",
        "LoraWeaveConditioningRuntime",
    }
)
# node id -> the module that defines it (comfy/nodes.py, but for the Multi Loader and the conditioning nodes)
NODE_MODULES = {
    node: "loraweave.comfy.multi_loader"
    if node == "LoraWeaveMultiLoader"
    else "loraweave.comfy.cond_nodes"
    if node.startswith("LoraWeaveConditioning")
    else "loraweave.comfy.nodes"
    for node in NODE_IDS
}
# Flux modules of ComfyUI's tiny Flux (hidden 128) a kohya Flux LoRA names: (kohya stem, ComfyUI state-dict
# key).
FLUX_TARGETS = {
    "lora_unet_double_blocks_0_img_attn_proj": "diffusion_model.double_blocks.0.img_attn.proj.weight",
    "lora_unet_double_blocks_0_txt_mlp_0": "diffusion_model.double_blocks.0.txt_mlp.0.weight",
}
# A kohya SD1 UNet key: lands on no Flux module (the wrong-architecture file).
SD1_STEM = "lora_unet_down_blocks_0_attentions_0_proj_in"
ABSENT_STEM = "lora_unet_double_blocks_7_img_attn_proj"  # block 7 of a 1-block Flux: a key that misses
RANK, ALPHA = 4, 2.0
TAGS = {"1_cat": {"sks cat": 12, "sitting": 3, "outdoors": 5}, "1_more": {"sitting": 4}}


def lora_pair(stem: str, out_features: int, in_features: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"{stem}.lora_down.weight": torch.randn(RANK, in_features, generator=g) * 0.1,
        f"{stem}.lora_up.weight": torch.randn(out_features, RANK, generator=g) * 0.1,
        f"{stem}.alpha": torch.tensor(ALPHA),
    }


def flux_lora(seed: int = 1) -> dict[str, torch.Tensor]:
    """kohya Flux LoRA on the tiny Flux: img_attn.proj (128x128) and txt_mlp.0 (512x128)."""
    return {
        **lora_pair("lora_unet_double_blocks_0_img_attn_proj", 128, 128, seed),
        **lora_pair("lora_unet_double_blocks_0_txt_mlp_0", 512, 128, seed + 1),
    }


def write_loras(folder: Path) -> dict[str, Path]:
    """The files the node tests load by name from the loras folder."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "flux.safetensors": flux_lora(),
        "partial.safetensors": {**flux_lora(), **lora_pair(ABSENT_STEM, 128, 128, 9)},
        "sd1.safetensors": lora_pair(SD1_STEM, 320, 320, 5),
    }
    metadata = {"ss_tag_frequency": json.dumps(TAGS), "ss_network_dim": str(RANK)}
    paths = {}
    for name, tensors in files.items():
        paths[name] = folder / name
        save_file(tensors, paths[name], metadata=metadata if name == "flux.safetensors" else None)
    paths["broken.safetensors"] = folder / "broken.safetensors"
    paths["broken.safetensors"].write_bytes(b"\xff" * 8 + b"not a safetensors header")
    return paths


def merged_reference(weight: torch.Tensor, tensors: dict[str, torch.Tensor], stem: str, strength: float):
    """W + strength * alpha/rank * up @ down in fp64 (kohya's LoRA formula), independent of both libraries."""
    up = tensors[f"{stem}.lora_up.weight"].double()
    down = tensors[f"{stem}.lora_down.weight"].double()
    alpha = float(tensors[f"{stem}.alpha"])
    return weight.double() + strength * alpha / down.shape[0] * (up @ down)


def fake_comfyui(root: Path) -> Path:
    """A folder with the files install checks for (main.py, nodes.py, folder_paths.py, comfy/,
    comfy_extras/)."""
    for folder in ("comfy", "comfy_extras", "custom_nodes"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    for name in ("main.py", "nodes.py", "folder_paths.py"):
        (root / name).write_text("# stand-in\n")
    return root
