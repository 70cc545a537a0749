"""Qwen-Image 2.1: original (ComfyUI) names -> diffusers QwenImage21Transformer2DModel modules.

Source: diffusers `convert_qwen_image21_transformer_checkpoint_to_diffusers` (no LoRA converter exists). ComfyUI
fuses the SwiGLU gate and up projections into one `img_mlp.gate_up`, gate rows first: its top half is
`img_mlp.gate_layer`, its bottom half `img_mlp.proj`. Every other module keeps its diffusers name (behind
`model.diffusion_model.` / `diffusion_model.`, which the key parser strips); DiffSynth's `lora_A.default.weight`
adapter names are generic.
"""

from __future__ import annotations

from .spec import Alias, ArchTable

_MLP = "transformer_blocks.{i}.img_mlp"

QWENIMAGE21 = ArchTable(
    name="qwenimage21",
    classes=("QwenImage21Transformer2DModel",),
    aliases=(Alias(f"{_MLP}.gate_up", (f"{_MLP}.gate_layer", f"{_MLP}.proj")),),
)
