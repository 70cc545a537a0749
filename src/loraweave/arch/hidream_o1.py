"""HiDream-O1: named, not mapped. Its denoiser is the Qwen3-VL-8B decoder itself (`language_model.layers.N`,
a pixel-space patch shim, `final_layer2.linear`); ComfyUI's newest tree holds it (`comfy/ldm/hidream_o1`,
supported model HiDreamO1) but diffusers 0.42.1 has no model class, and loraweave resolves every file on a
diffusers module tree (the ComfyUI pack too, through a reference tree of the diffusers class). Detection
names its files (Wan2GP #1831: bare `final_layer2.linear`, `language_model.layers.N.mlp.down_proj`;
ModelScope's trainer: `model.` in front, ComfyUI PR #14767): `inspect` says what they are; on any model they
land no key and are refused (NoKeysLandedError), never landed in part. No skeleton, so the other-architecture
refusal (arch/fit.py: concrete records only) does not name it."""

from __future__ import annotations

from .record import Architecture

HIDREAM_O1 = Architecture(
    "hidream-o1",
    label="HiDream-O1",
    signature=r"^(model_)?(final_layer2_linear|language_model_layers_\d+_mlp_(gate|up|down)_proj)$",
    not_mapped=(
        "HiDream-O1",
        "named by detection (final_layer2.linear, language_model.layers.N.mlp.*; bare or model.), no key "
        "lands on other models (refused); not applied: no diffusers model class in 0.42.1 (ComfyUI's "
        "comfy/ldm/hidream_o1 only), and every face resolves on a diffusers module tree "
        "(test_arch_layout_classes.py)",
    ),
)
