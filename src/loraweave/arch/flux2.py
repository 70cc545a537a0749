"""Flux.2 (incl. klein) transformer: BFL/ComfyUI original names -> diffusers Flux2Transformer2DModel modules.

Source: diffusers `convert_flux2_transformer_checkpoint_to_diffusers`. Unlike Flux.1, the single block's fused
`linear1` (q | k | v | SwiGLU pair) is one module on both sides (`attn.to_qkv_mlp_proj`), as is `linear2`
(`attn.to_out`); the SwiGLU halves of `img_mlp.0` / `linear1` keep their order (the converter copies them
as-is). Modulation is global (`double_stream_modulation_img/txt`, `single_stream_modulation`), same chunk
order both sides.
"""

from __future__ import annotations

from .flux import double_single_from_comfy
from .record import Architecture, ComfyFacets, Layouts, Release, Skeleton
from .spec import Alias, ArchTable, Rows

_D = "transformer_blocks.{i}"
_S = "single_transformer_blocks.{i}"


def _stream(src: str, attn: tuple[str, ...], ff: str) -> tuple[Alias, ...]:
    b, (q, k, v, out, nq, nk) = f"double_blocks.{{i}}.{src}", attn
    return (
        Alias(f"{b}_attn.qkv", (f"{_D}.attn.{q}", f"{_D}.attn.{k}", f"{_D}.attn.{v}")),
        Alias(f"{b}_attn.proj", (f"{_D}.attn.{out}",)),
        Alias(f"{b}_attn.norm.query_norm", (f"{_D}.attn.{nq}",)),
        Alias(f"{b}_attn.norm.key_norm", (f"{_D}.attn.{nk}",)),
        Alias(f"{b}_mlp.0", (f"{_D}.{ff}.linear_in",)),  # SwiGLU (gate, value) rows, same order both sides
        Alias(f"{b}_mlp.2", (f"{_D}.{ff}.linear_out",)),
    )


_IMG = ("to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k")
_TXT = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q", "norm_added_k")

FLUX2 = ArchTable(
    name="flux2",
    classes=("Flux2Transformer2DModel",),
    aliases=(
        *_stream("img", _IMG, "ff"),
        *_stream("txt", _TXT, "ff_context"),
        # diffusers' own fused spellings (BFL LoKr converted by diffusers lands on `fuse_qkv_projections()`
        # modules); a live fused module of that name wins over these aliases.
        Alias(f"{_D}.attn.to_qkv", (f"{_D}.attn.to_q", f"{_D}.attn.to_k", f"{_D}.attn.to_v")),
        Alias(
            f"{_D}.attn.to_added_qkv",
            (f"{_D}.attn.add_q_proj", f"{_D}.attn.add_k_proj", f"{_D}.attn.add_v_proj"),
        ),
        Alias("single_blocks.{i}.linear1", (f"{_S}.attn.to_qkv_mlp_proj",)),
        Alias("single_blocks.{i}.linear2", (f"{_S}.attn.to_out",)),
        Alias("single_blocks.{i}.norm.query_norm", (f"{_S}.attn.norm_q",)),
        Alias("single_blocks.{i}.norm.key_norm", (f"{_S}.attn.norm_k",)),
        Alias("double_stream_modulation_img.lin", ("double_stream_modulation_img.linear",)),
        Alias("double_stream_modulation_txt.lin", ("double_stream_modulation_txt.linear",)),
        Alias("single_stream_modulation.lin", ("single_stream_modulation.linear",)),
        Alias("img_in", ("x_embedder",)),
        Alias("txt_in", ("context_embedder",)),
        Alias("time_in.in_layer", ("time_guidance_embed.timestep_embedder.linear_1",)),
        Alias("time_in.out_layer", ("time_guidance_embed.timestep_embedder.linear_2",)),
        Alias("guidance_in.in_layer", ("time_guidance_embed.guidance_embedder.linear_1",)),
        Alias("guidance_in.out_layer", ("time_guidance_embed.guidance_embedder.linear_2",)),
        # BFL (shift, scale); diffusers AdaLayerNormContinuous (scale, shift): swap the halves.
        Alias(
            "final_layer.adaLN_modulation.1", (Rows("norm_out.linear", 1, 2), Rows("norm_out.linear", 0, 2))
        ),
        Alias("final_layer.linear", ("proj_out",)),
    ),
)


def _flux2_from_comfy(cfg: dict) -> dict:
    return {
        **double_single_from_comfy(cfg),
        "mlp_ratio": cfg.get("mlp_ratio", 3.0),
        "rope_theta": cfg.get("theta", 2000),
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }


# Releases (in `releases=`): dev is diffusers' Flux2Transformer2DModel defaults; klein from the released
# transformer configs as DiffSynth-Studio's model_configs.py lists them (klein-4B: 5 double / 20 single
# blocks, 24 heads x 128; klein-9B: 8 / 24, 32 heads x 128).
FLUX2_ARCH = Architecture(
    "flux2",
    (FLUX2,),
    label="Flux.2",
    signature=r"double_stream_modulation|single_stream_modulation|to_qkv_mlp_proj",
    skeleton=Skeleton("transformer", "Flux2Transformer2DModel", {}, {}, "Flux2Transformer2DModel defaults"),
    layouts=Layouts(
        "flux2 (dev, klein)",
        "BFL/ComfyUI names, BFL LoKr; klein 4B/9B told apart by block counts, width and linear1 rows",
        "convert_flux2_transformer_checkpoint_to_diffusers",
        "test_arch_dits2.py, test_arch_wan_animate_variants.py::test_*klein*",
    ),
    releases=(
        Release("flux2-dev", {"double": 8, "single": 48}, 6144, 9, "flux2"),
        Release("flux2-klein-9b", {"double": 8, "single": 24}, 4096, 9, "flux2-klein-9b"),
        Release("flux2-klein-4b", {"double": 5, "single": 20}, 3072, 9, "flux2-klein-4b"),
    ),
    comfy=ComfyFacets(("Flux2",), _flux2_from_comfy, skeleton="flux2"),
)
FLUX2_KLEIN_4B = Architecture(
    "flux2-klein-4b",
    label="Flux.2 klein 4B",
    skeleton=Skeleton(
        "transformer",
        "Flux2Transformer2DModel",
        dict(
            num_layers=5,
            num_single_layers=20,
            num_attention_heads=24,
            joint_attention_dim=7680,
            guidance_embeds=False,
        ),
        {},
        "FLUX.2-klein-4B transformer config",
    ),
)
FLUX2_KLEIN_9B = Architecture(
    "flux2-klein-9b",
    label="Flux.2 klein 9B",
    skeleton=Skeleton(
        "transformer",
        "Flux2Transformer2DModel",
        dict(
            num_layers=8,
            num_single_layers=24,
            num_attention_heads=32,
            joint_attention_dim=12288,
            guidance_embeds=False,
        ),
        {},
        "FLUX.2-klein-9B transformer config",
    ),
)
