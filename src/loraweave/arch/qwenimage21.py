"""Qwen-Image 2.1: original (ComfyUI) names -> diffusers QwenImage21Transformer2DModel modules.

Source: diffusers `convert_qwen_image21_transformer_checkpoint_to_diffusers` (no LoRA converter exists).
ComfyUI fuses the SwiGLU gate and up projections into one `img_mlp.gate_up`, gate rows first: its top half is
`img_mlp.gate_layer`, its bottom half `img_mlp.proj`. Every other module keeps its diffusers name (behind
`model.diffusion_model.` / `diffusion_model.`, which the key parser strips); DiffSynth's
`lora_A.default.weight` adapter names are generic.
"""

from __future__ import annotations

from .flux import nunchaku_modulation
from .record import Architecture, BlockMap, ComfyFacets, Layouts, Skeleton
from .spec import Alias, ArchTable, Rows

_MLP = "transformer_blocks.{i}.img_mlp"

QWENIMAGE21 = ArchTable(
    name="qwenimage21",
    classes=("QwenImage21Transformer2DModel",),
    aliases=(Alias(f"{_MLP}.gate_up", (f"{_MLP}.gate_layer", f"{_MLP}.proj")),),
)

# Qwen-Image 2.1's SwiGLU (`gate_layer` / `proj` / `out`, ComfyUI's fused `gate_up`) vs Qwen-Image's
# `net.0.proj`.
QWEN_IMAGE_21 = Architecture(
    "qwen-image-2.1",
    (QWENIMAGE21,),
    label="Qwen-Image 2.1",
    signature=r"^transformer_blocks_\d+_img_mlp_(gate_up|gate_layer|proj|out)$",
    skeleton=Skeleton(
        "transformer",
        "QwenImage21Transformer2DModel",
        {},
        {},
        "QwenImage21Transformer2DModel defaults (32 blocks, 32 heads x 128)",
    ),
    cli_names=("qwen-image-21", "qwenimage21"),
    layouts=Layouts(
        "qwen-image 2.1",
        "ComfyUI names (fused img_mlp.gate_up), DiffSynth default. names",
        "convert_qwen_image21_transformer_checkpoint_to_diffusers (on lora_B)",
        "test_arch_minimax_ideogram_qwen21.py::test_qwen21_*",
    ),
)


def _qwen_image_from_comfy(cfg: dict) -> dict:
    # ComfyUI's detection writes only in_channels and depth; the rest are its model class's defaults.
    return {
        "in_channels": cfg.get("in_channels", 64),
        "out_channels": cfg.get("out_channels") or 16,
        "num_layers": cfg.get("num_layers", 60),
        "attention_head_dim": cfg.get("attention_head_dim", 128),
        "num_attention_heads": cfg.get("num_attention_heads", 24),
        "joint_attention_dim": cfg.get("joint_attention_dim", 3584),
        "axes_dims_rope": tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
    }


_B = "transformer_blocks.{i}"


def _thirds(fused: str, parts: tuple[str, ...]) -> tuple[Alias, ...]:
    return tuple(Alias(f"{_B}.attn.{p}", (Rows(f"{_B}.attn.{fused}", n, 3),)) for n, p in enumerate(parts))


# Qwen-Image keeps diffusers' names. Nunchaku's (SVDQuant W4A4) fuses q/k/v into `attn.to_qkv` and the text
# stream's into `attn.add_qkv_proj` (rows q | k | v; diffusers' own `fuse_qkv_projections` gives the same
# rows) and holds the modulation `img_mod.1` / `txt_mod.1` in AWQ W4A16 with its rows interleaved per hidden
# unit (a delta lands with its rows gathered into that order, see flux.nunchaku_modulation).
QWEN_IMAGE_TABLE = ArchTable(
    name="qwen-image",
    classes=("QwenImageTransformer2DModel", "NunchakuQwenImageTransformer2DModel"),
    aliases=(),
    runtime_fusions=(
        *_thirds("to_qkv", ("to_q", "to_k", "to_v")),
        *_thirds("add_qkv_proj", ("add_q_proj", "add_k_proj", "add_v_proj")),
    ),
    interleaved_rows=(nunchaku_modulation((f"{_B}.img_mod.1", f"{_B}.txt_mod.1"), 6),),
)

# Qwen-Image: diffusers names; its attention names are Flux's, 60 double-stream blocks deep (no single
# blocks).
QWEN_IMAGE = Architecture(
    "qwen-image",
    (QWEN_IMAGE_TABLE,),
    label="Qwen-Image",
    signature=r"^transformer_blocks_\d+_(img|txt)_(mlp|mod)",
    owners=("qwen-image-2.1",),
    depth=("flux", {"double": 60}),
    skeleton=Skeleton(
        "transformer",
        "QwenImageTransformer2DModel",
        dict(
            attention_head_dim=128,
            axes_dims_rope=[16, 56, 56],
            guidance_embeds=False,
            in_channels=64,
            joint_attention_dim=3584,
            num_attention_heads=24,
            num_layers=60,
            out_channels=16,
            patch_size=2,
        ),
        {},
        "qwen-image transformer config",
    ),
    cli_names=("qwen",),
    blocks=BlockMap("qwen_image", (("B", "transformer_blocks", 60),)),
    comfy=ComfyFacets(
        ("QwenImage",), _qwen_image_from_comfy, {"num_layers": ("transformer_blocks",)}, skeleton="qwen-image"
    ),
)
