"""PixArt-alpha/Sigma: diffusers names (the cross-attention DiT family's), named by the hidden width; and the
original (PixArt, ComfyUI) names -> diffusers modules.

Source: ComfyUI's `comfy.utils.pixart_to_diffusers` (diffusers ships no single-file converter for PixArt; its
conversion script `convert_pixart_sigma_to_diffusers.py` makes the same map): the self-attention `attn.qkv` is
q | k | v, the cross-attention `kv_linear` is k | v, each in equal row thirds / halves; Alpha's size and
aspect-ratio embedders are `csize_embedder` / `ar_embedder`."""

from __future__ import annotations

from .record import Architecture, ComfyFacets, Layouts, Skeleton
from .spec import Alias, ArchTable, ParamAlias

_B, _T = "blocks.{i}", "transformer_blocks.{i}"
_EMB = "adaln_single.emb"

PIXART_TABLE = ArchTable(
    name="pixart",
    classes=("PixArtTransformer2DModel",),
    aliases=(
        Alias(f"{_B}.attn.qkv", (f"{_T}.attn1.to_q", f"{_T}.attn1.to_k", f"{_T}.attn1.to_v")),
        Alias(f"{_B}.attn.proj", (f"{_T}.attn1.to_out.0",)),
        Alias(f"{_B}.cross_attn.q_linear", (f"{_T}.attn2.to_q",)),
        Alias(f"{_B}.cross_attn.kv_linear", (f"{_T}.attn2.to_k", f"{_T}.attn2.to_v")),
        Alias(f"{_B}.cross_attn.proj", (f"{_T}.attn2.to_out.0",)),
        Alias(f"{_B}.mlp.fc1", (f"{_T}.ff.net.0.proj",)),
        Alias(f"{_B}.mlp.fc2", (f"{_T}.ff.net.2",)),
        Alias("x_embedder.proj", ("pos_embed.proj",)),
        Alias("t_embedder.mlp.0", (f"{_EMB}.timestep_embedder.linear_1",)),
        Alias("t_embedder.mlp.2", (f"{_EMB}.timestep_embedder.linear_2",)),
        Alias("csize_embedder.mlp.0", (f"{_EMB}.resolution_embedder.linear_1",)),
        Alias("csize_embedder.mlp.2", (f"{_EMB}.resolution_embedder.linear_2",)),
        Alias("ar_embedder.mlp.0", (f"{_EMB}.aspect_ratio_embedder.linear_1",)),
        Alias("ar_embedder.mlp.2", (f"{_EMB}.aspect_ratio_embedder.linear_2",)),
        Alias("t_block.1", ("adaln_single.linear",)),
        Alias("y_embedder.y_proj.fc1", ("caption_projection.linear_1",)),
        Alias("y_embedder.y_proj.fc2", ("caption_projection.linear_2",)),
        Alias("final_layer.linear", ("proj_out",)),
    ),
    parameters=(
        ParamAlias(f"{_B}.scale_shift_table", f"{_T}.scale_shift_table"),
        ParamAlias("final_layer.scale_shift_table", "scale_shift_table"),
    ),
)


def _pixart_from_comfy(cfg: dict) -> dict:
    # ComfyUI's PixArtMS: Alpha's size / aspect-ratio embedders when micro_condition is set (detected from
    # ar_embedder), a sigma-predicting output twice the input channels, the caption projected to the hidden
    # width.
    hidden, heads, in_channels = (
        cfg.get("hidden_size", 1152),
        cfg.get("num_heads", 16),
        cfg.get("in_channels", 4),
    )
    return {
        "num_attention_heads": heads,
        "attention_head_dim": hidden // heads,
        "in_channels": in_channels,
        "out_channels": in_channels * 2 if cfg.get("pred_sigma", True) else in_channels,
        "num_layers": cfg["depth"],
        "cross_attention_dim": hidden,
        "patch_size": cfg.get("patch_size", 2),
        "caption_channels": cfg.get("caption_channels", 4096),
        "use_additional_conditions": bool(cfg.get("micro_condition", True)),
    }


PIXART = Architecture(
    "pixart",
    (PIXART_TABLE,),
    label="PixArt",
    skeleton=Skeleton(
        "transformer",
        "PixArtTransformer2DModel",
        {},
        {},
        "PixArtTransformer2DModel defaults (PixArt-alpha/Sigma: 28 blocks, hidden 1152)",
    ),
    cli_names=("pixart-sigma", "pixart-alpha"),
    layouts=Layouts(
        "pixart (alpha, sigma)",
        "PixArt/ComfyUI names (fused attn.qkv, cross_attn.kv_linear as k, v halves, t_block, y_embedder, "
        "Alpha's csize/ar_embedder, scale_shift_table parameters)",
        "comfy.utils.pixart_to_diffusers (diffusers ships no PixArt single-file or LoRA converter)",
        "test_comfy_arch_weights.py::test_pixart_*",
    ),
    comfy=ComfyFacets(("PixArtAlpha", "PixArtSigma"), _pixart_from_comfy, skeleton="pixart"),
)
