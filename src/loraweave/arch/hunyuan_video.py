"""HunyuanVideo transformer: original / diffusion-pipe names -> diffusers HunyuanVideoTransformer3DModel
modules.

Source: diffusers `convert_hunyuan_video_transformer_to_diffusers`. The Tencent names (`img_attn_qkv`,
`img_mod.linear`, `img_mlp.fc1`, ...) are what the original checkpoint and diffusion-pipe / musubi LoRAs use.
ComfyUI's internal model renames them Flux-style (`img_attn.qkv`, `img_mod.lin`, `img_mlp.0`, ...;
`process_unet_state_dict`), so every name
is registered in both spellings. Fused rows: `*_attn_qkv` = q | k | v thirds; single `linear1` = q | k | v |
mlp.
"""

from __future__ import annotations

from .encoders import CLIP_L
from .record import Architecture, ComfyFacets, Layouts, Release, Skeleton
from .spec import Alias, ArchTable, Rows

_D = "transformer_blocks.{i}"
_S = "single_transformer_blocks.{i}"
_R = "context_embedder.token_refiner.refiner_blocks.{i}"
_T = "txt_in.individual_token_refiner.blocks.{i}"


def _stream(src: str, attn: tuple[str, ...], norm: str, ff: str) -> tuple[Alias, ...]:
    b, (q, k, v, out, nq, nk) = f"double_blocks.{{i}}.{src}", attn
    return (
        Alias(f"{b}_attn_qkv", (f"{_D}.attn.{q}", f"{_D}.attn.{k}", f"{_D}.attn.{v}")),
        Alias(f"{b}_attn_proj", (f"{_D}.attn.{out}",)),
        Alias(f"{b}_attn_q_norm", (f"{_D}.attn.{nq}",)),
        Alias(f"{b}_attn_k_norm", (f"{_D}.attn.{nk}",)),
        # (shift, scale, gate) x 2 in the same order on both sides.
        Alias(f"{b}_mod.linear", (f"{_D}.{norm}.linear",)),
        Alias(f"{b}_mlp.fc1", (f"{_D}.{ff}.net.0.proj",)),
        Alias(f"{b}_mlp.fc2", (f"{_D}.{ff}.net.2",)),
    )


_IMG = ("to_q", "to_k", "to_v", "to_out.0", "norm_q", "norm_k")
_TXT = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "norm_added_q", "norm_added_k")
# Both streams of the double blocks (HunyuanVideo 1.5 and HunyuanImage 2.1 share them: hunyuan_video15.py).
DOUBLE = (*_stream("img", _IMG, "norm1", "ff"), *_stream("txt", _TXT, "norm1_context", "ff_context"))
# The token refiner in front of the text stream (`txt_in`), also shared by 1.5 and 2.1.
REFINER = (
    Alias("txt_in.input_embedder", ("context_embedder.proj_in",)),
    Alias("txt_in.t_embedder.mlp.0", ("context_embedder.time_text_embed.timestep_embedder.linear_1",)),
    Alias("txt_in.t_embedder.mlp.2", ("context_embedder.time_text_embed.timestep_embedder.linear_2",)),
    Alias("txt_in.c_embedder.linear_1", ("context_embedder.time_text_embed.text_embedder.linear_1",)),
    Alias("txt_in.c_embedder.linear_2", ("context_embedder.time_text_embed.text_embedder.linear_2",)),
    Alias(f"{_T}.self_attn_qkv", (f"{_R}.attn.to_q", f"{_R}.attn.to_k", f"{_R}.attn.to_v")),
    Alias(f"{_T}.self_attn_proj", (f"{_R}.attn.to_out.0",)),
    Alias(f"{_T}.norm1", (f"{_R}.norm1",)),
    Alias(f"{_T}.norm2", (f"{_R}.norm2",)),
    Alias(f"{_T}.mlp.fc1", (f"{_R}.ff.net.0.proj",)),
    Alias(f"{_T}.mlp.fc2", (f"{_R}.ff.net.2",)),
    Alias(f"{_T}.adaLN_modulation.1", (f"{_R}.norm_out.linear",)),  # (gate_msa, gate_mlp): no swap
)
# linear1 rows are q | k | v | mlp; widths come from the live modules (diffusers' converter hard-codes 3072).
SINGLE = (
    Alias(
        "single_blocks.{i}.linear1",
        (f"{_S}.attn.to_q", f"{_S}.attn.to_k", f"{_S}.attn.to_v", f"{_S}.proj_mlp"),
    ),
    Alias("single_blocks.{i}.linear2", (f"{_S}.proj_out",)),
    Alias("single_blocks.{i}.q_norm", (f"{_S}.attn.norm_q",)),
    Alias("single_blocks.{i}.k_norm", (f"{_S}.attn.norm_k",)),
    Alias("single_blocks.{i}.modulation.linear", (f"{_S}.norm.linear",)),
)
FINAL = (
    Alias("img_in.proj", ("x_embedder.proj",)),
    # Original (shift, scale); diffusers AdaLayerNormContinuous (scale, shift): swap the halves.
    Alias("final_layer.adaLN_modulation.1", (Rows("norm_out.linear", 1, 2), Rows("norm_out.linear", 0, 2))),
    Alias("final_layer.linear", ("proj_out",)),
)
_TENCENT = (
    *DOUBLE,
    *SINGLE,
    *REFINER,
    *FINAL,
    Alias("time_in.mlp.0", ("time_text_embed.timestep_embedder.linear_1",)),
    Alias("time_in.mlp.2", ("time_text_embed.timestep_embedder.linear_2",)),
    Alias("guidance_in.mlp.0", ("time_text_embed.guidance_embedder.linear_1",)),
    Alias("guidance_in.mlp.2", ("time_text_embed.guidance_embedder.linear_2",)),
    Alias("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
    Alias("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
)

# ComfyUI `HunyuanVideo.process_unet_state_dict`, in its order (applied to "<name>.").
_COMFY_RENAMES = (
    ("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer."),
    ("txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."),
    ("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer."),
    ("txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."),
    ("_mod.linear.", "_mod.lin."),
    ("_attn_qkv.", "_attn.qkv."),
    ("mlp.fc1.", "mlp.0."),
    ("mlp.fc2.", "mlp.2."),
    ("_attn_q_norm.", "_attn.norm.query_norm."),
    ("_attn_k_norm.", "_attn.norm.key_norm."),
    (".q_norm.", ".norm.query_norm."),
    (".k_norm.", ".norm.key_norm."),
    ("_attn_proj.", "_attn.proj."),
    (".modulation.linear.", ".modulation.lin."),
    ("_in.mlp.2.", "_in.out_layer."),
    ("_in.mlp.0.", "_in.in_layer."),
)


def comfy_name(name: str) -> str:
    out = name + "."
    for old, new in _COMFY_RENAMES:
        out = out.replace(old, new)
    return out[:-1]


def with_comfy_spellings(aliases: tuple[Alias, ...]) -> tuple[Alias, ...]:
    """The aliases, then each again under ComfyUI's spelling of its source where that differs."""
    return (
        *aliases,
        *(Alias(comfy_name(a.source), a.targets) for a in aliases if comfy_name(a.source) != a.source),
    )


HUNYUAN_VIDEO = ArchTable(
    name="hunyuan-video",
    classes=("HunyuanVideoTransformer3DModel",),
    aliases=with_comfy_spellings(_TENCENT),
)


def hunyuan_from_comfy(cfg: dict) -> dict:
    """What ComfyUI's HunyuanVideo class (HunyuanVideo, 1.5, HunyuanImage 2.1) sets alike: heads of 128 (its
    detection), a token refiner always 2 blocks deep."""
    return {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg["out_channels"],
        "num_attention_heads": cfg["num_heads"],
        "attention_head_dim": cfg["hidden_size"] // cfg["num_heads"],
        "num_layers": cfg["depth"],
        "num_refiner_layers": 2,
        "mlp_ratio": cfg.get("mlp_ratio", 4.0),
        "text_embed_dim": cfg["context_in_dim"],
        "rope_axes_dim": tuple(cfg["axes_dim"]),
        "rope_theta": float(cfg.get("theta", 256)),
    }


def video_patch_from_comfy(cfg: dict, default: tuple[int, ...]) -> dict:
    patch = list(cfg.get("patch_size", default))
    return {"patch_size": patch[-1], "patch_size_t": patch[0] if len(patch) == 3 else 1}


def _hunyuan_video_from_comfy(cfg: dict) -> dict:
    return {
        **hunyuan_from_comfy(cfg),
        **video_patch_from_comfy(cfg, (1, 2, 2)),
        "num_single_layers": cfg["depth_single_blocks"],
        "pooled_projection_dim": cfg.get("vec_in_dim") or 768,
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }


# Tencent names: `img_mod.linear` / `modulation.linear` / `mlp.fc1` vs Flux's `img_mod.lin` / `img_mlp.0`. Its
# diffusers names are Flux's, 20 double / 40 single blocks deep (both 24 heads x 128; `releases=` below).
HUNYUAN_VIDEO_ARCH = Architecture(
    "hunyuan-video",
    (HUNYUAN_VIDEO,),
    label="HunyuanVideo",
    signature=r"^(double|single)_blocks_\d+_.*(mod_linear|modulation_linear|mlp_fc[12])$|individual_token_refiner|token_refiner_refiner_blocks",
    depth=("flux", {"double": 20, "single": 40}),
    skeleton=Skeleton(
        "transformer",
        "HunyuanVideoTransformer3DModel",
        dict(
            in_channels=16,
            out_channels=16,
            num_attention_heads=24,
            attention_head_dim=128,
            num_layers=20,
            num_single_layers=40,
            num_refiner_layers=2,
            mlp_ratio=4.0,
            patch_size=2,
            patch_size_t=1,
            qk_norm="rms_norm",
            guidance_embeds=True,
            text_embed_dim=4096,
            pooled_projection_dim=768,
            rope_theta=256.0,
            rope_axes_dim=[16, 56, 56],
        ),
        {"text_encoder_2": CLIP_L},
        "HunyuanVideo T2V config",
    ),
    cli_names=("hunyuan",),
    layouts=Layouts(
        "hunyuan-video",
        "Tencent names, ComfyUI renames, diffusion-pipe",
        "convert_hunyuan_video_transformer_to_diffusers",
        "test_arch_dits2.py",
    ),
    releases=(Release("hunyuan-video (T2V, I2V)", {"double": 20, "single": 40}, 3072, 7),),
    comfy=ComfyFacets(("HunyuanVideo",), _hunyuan_video_from_comfy, skeleton="hunyuan-video"),
)
