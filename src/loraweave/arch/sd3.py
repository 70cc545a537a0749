"""SD3 / SD3.5 MMDiT: original (`joint_blocks.N.x_block/context_block`) names -> diffusers modules."""

from __future__ import annotations

from .encoders import CLIP_G, CLIP_L, T5_XXL
from .record import Architecture, BlockMap, ComfyFacets, Layouts, Skeleton
from .spec import Alias, ArchTable, Rows

_B = "transformer_blocks.{i}"


def _attn(src: str, dst: str, q: str, k: str, v: str, out: str, norm: str) -> tuple[Alias, ...]:
    return (
        Alias(f"joint_blocks.{{i}}.{src}.qkv", (f"{_B}.{dst}.{q}", f"{_B}.{dst}.{k}", f"{_B}.{dst}.{v}")),
        Alias(f"joint_blocks.{{i}}.{src}.proj", (f"{_B}.{dst}.{out}",)),
        Alias(f"joint_blocks.{{i}}.{src}.ln_q", (f"{_B}.{dst}.{norm}_q",)),
        Alias(f"joint_blocks.{{i}}.{src}.ln_k", (f"{_B}.{dst}.{norm}_k",)),
    )


SD3 = ArchTable(
    name="sd3",
    classes=("SD3Transformer2DModel",),
    aliases=(
        *_attn("x_block.attn", "attn", "to_q", "to_k", "to_v", "to_out.0", "norm"),
        *_attn("x_block.attn2", "attn2", "to_q", "to_k", "to_v", "to_out.0", "norm"),  # SD3.5 dual attention
        *_attn(
            "context_block.attn", "attn", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added"
        ),
        Alias("joint_blocks.{i}.x_block.mlp.fc1", (f"{_B}.ff.net.0.proj",)),
        Alias("joint_blocks.{i}.x_block.mlp.fc2", (f"{_B}.ff.net.2",)),
        Alias("joint_blocks.{i}.context_block.mlp.fc1", (f"{_B}.ff_context.net.0.proj",)),
        Alias("joint_blocks.{i}.context_block.mlp.fc2", (f"{_B}.ff_context.net.2",)),
        # (shift, scale, gate) x 2 in the same order on both sides ...
        Alias("joint_blocks.{i}.x_block.adaLN_modulation.1", (f"{_B}.norm1.linear",)),
        Alias("joint_blocks.{i}.context_block.adaLN_modulation.1", (f"{_B}.norm1_context.linear",)),
        # ... except the last block's context norm: original (shift, scale), diffusers (scale, shift).
        Alias(
            "joint_blocks.{i}.context_block.adaLN_modulation.1",
            (Rows(f"{_B}.norm1_context.linear", 1, 2), Rows(f"{_B}.norm1_context.linear", 0, 2)),
            when_parent="AdaLayerNormContinuous",
        ),
        Alias("x_embedder.proj", ("pos_embed.proj",)),
        Alias("t_embedder.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
        Alias("t_embedder.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
        Alias("y_embedder.mlp.0", ("time_text_embed.text_embedder.linear_1",)),
        Alias("y_embedder.mlp.2", ("time_text_embed.text_embedder.linear_2",)),
        Alias("final_layer.linear", ("proj_out",)),
        Alias(
            "final_layer.adaLN_modulation.1", (Rows("norm_out.linear", 1, 2), Rows("norm_out.linear", 0, 2))
        ),
    ),
)


def _sd3_from_comfy(cfg: dict) -> dict:
    # ComfyUI's MMDiT: hidden = 64 * depth, depth heads of 64; the caption projection is the hidden width.
    depth, context = cfg["depth"], cfg.get("context_embedder_config") or {}
    out = {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg.get("out_channels") or cfg["in_channels"],
        "patch_size": cfg.get("patch_size", 2),
        "num_layers": depth,
        "num_attention_heads": depth,
        "attention_head_dim": 64,
        "caption_projection_dim": 64 * depth,
        "dual_attention_layers": tuple(cfg.get("x_block_self_attn_layers") or ()),
        "qk_norm": "rms_norm" if cfg.get("qk_norm") == "rms" else None,
    }
    if cfg.get("adm_in_channels"):
        out["pooled_projection_dim"] = cfg["adm_in_channels"]
    if context.get("params"):
        out["joint_attention_dim"] = context["params"]["in_features"]
    if cfg.get("pos_embed_max_size"):
        out["pos_embed_max_size"] = cfg["pos_embed_max_size"]
    return out


SD3_ARCH = Architecture(
    "sd3",
    (SD3,),
    label="SD3",
    signature=r"^joint_blocks_\d+_(x|context)_block",
    skeleton=Skeleton(
        "transformer",
        "SD3Transformer2DModel",
        dict(
            attention_head_dim=64,
            caption_projection_dim=1536,
            in_channels=16,
            joint_attention_dim=4096,
            num_attention_heads=24,
            num_layers=24,
            out_channels=16,
            patch_size=2,
            pooled_projection_dim=2048,
            pos_embed_max_size=192,
            sample_size=128,
        ),
        {"text_encoder": CLIP_L, "text_encoder_2": CLIP_G, "text_encoder_3": T5_XXL},
        "sd3-medium transformer config",
    ),
    cli_names=("sd3.5",),
    blocks=BlockMap("sd3", (("B", "transformer_blocks", 24),)),
    layouts=Layouts(
        "sd3",
        "original MMDiT names",
        "convert_sd3_transformer_checkpoint_to_diffusers",
        "test_arch_oracle.py",
    ),
    comfy=ComfyFacets(("SD3",), _sd3_from_comfy, skeleton="sd3"),
)
