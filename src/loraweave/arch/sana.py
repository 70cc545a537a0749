"""Sana: original (NVlabs, ComfyUI) names -> diffusers SanaTransformer2DModel modules.

Source: diffusers `convert_sana_transformer_to_diffusers` (single-file converter; diffusers has no Sana LoRA
converter). Self-attention `attn.qkv` is q | k | v in equal thirds (torch.chunk 3), cross-attention
`kv_linear` is k | v in halves; the GLU feed-forward is three convs (`inverted_conv.conv`, `depth_conv.conv` -
depthwise 3x3 -, `point_conv.conv`). `blocks.N.scale_shift_table` and `final_layer.scale_shift_table` are bare
parameters. The converter maps the base Sana layout only: Sana 1.5's q/k norms and Sprint's guidance embedder
are not in it, so their original names are not here either (their diffusers names resolve as usual).
"""

from __future__ import annotations

from .record import Architecture, Layouts, Skeleton
from .spec import Alias, ArchTable, ParamAlias

_BLOCK = "transformer_blocks.{i}"


def _block() -> tuple[Alias, ...]:
    b, d = "blocks.{i}", _BLOCK
    return (
        Alias(f"{b}.attn.qkv", (f"{d}.attn1.to_q", f"{d}.attn1.to_k", f"{d}.attn1.to_v")),
        Alias(f"{b}.attn.proj", (f"{d}.attn1.to_out.0",)),
        Alias(f"{b}.cross_attn.q_linear", (f"{d}.attn2.to_q",)),
        Alias(f"{b}.cross_attn.kv_linear", (f"{d}.attn2.to_k", f"{d}.attn2.to_v")),
        Alias(f"{b}.cross_attn.proj", (f"{d}.attn2.to_out.0",)),
        Alias(f"{b}.mlp.inverted_conv.conv", (f"{d}.ff.conv_inverted",)),
        Alias(f"{b}.mlp.depth_conv.conv", (f"{d}.ff.conv_depth",)),
        Alias(f"{b}.mlp.point_conv.conv", (f"{d}.ff.conv_point",)),
    )


SANA = ArchTable(
    name="sana",
    classes=("SanaTransformer2DModel",),
    aliases=(
        *_block(),
        Alias("x_embedder.proj", ("patch_embed.proj",)),
        Alias("t_embedder.mlp.0", ("time_embed.emb.timestep_embedder.linear_1",)),
        Alias("t_embedder.mlp.2", ("time_embed.emb.timestep_embedder.linear_2",)),
        Alias("t_block.1", ("time_embed.linear",)),
        Alias("y_embedder.y_proj.fc1", ("caption_projection.linear_1",)),
        Alias("y_embedder.y_proj.fc2", ("caption_projection.linear_2",)),
        Alias("attention_y_norm", ("caption_norm",)),
        Alias("final_layer.linear", ("proj_out",)),
    ),
    parameters=(
        ParamAlias("blocks.{i}.scale_shift_table", f"{_BLOCK}.scale_shift_table"),
        ParamAlias("final_layer.scale_shift_table", "scale_shift_table"),
    ),
)

# Sana's GLUMBConv feed-forward in diffusers names (its attention names are the cross-attention DiTs'), and
# its original names (whose `cross_attn` would otherwise count as Wan's).
SANA_ARCH = Architecture(
    "sana",
    (SANA,),
    label="Sana",
    signature=r"^transformer_blocks_\d+_ff_conv_(inverted|depth|point)$"
    r"|^blocks_\d+_(attn_(qkv|proj)|cross_attn_(q_linear|kv_linear|proj)|mlp_(inverted|depth|point)_conv_conv)$",
    skeleton=Skeleton(
        "transformer",
        "SanaTransformer2DModel",
        {},
        {},
        "SanaTransformer2DModel defaults (Sana 1600M: 20 blocks, hidden 2240)",
    ),
    layouts=Layouts(
        "sana",
        "NVlabs/ComfyUI names (fused qkv, kv_linear, GLU convs, scale_shift_table parameters)",
        "convert_sana_transformer_to_diffusers (diffusers has no Sana LoRA converter)",
        "test_arch_anima_sana.py::test_sana_*",
    ),
)
