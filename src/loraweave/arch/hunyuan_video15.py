"""HunyuanVideo 1.5 and HunyuanImage 2.1: Tencent / ComfyUI names -> diffusers modules.

Sources (facts, read from diffusers' repo scripts, which the wheel does not install):
`convert_hunyuan_video1_5_to_diffusers.py` and `convert_hunyuan_image_to_diffusers.py`. Both models keep
HunyuanVideo's block names (hunyuan_video.py: `img_mod.linear`, `img_mlp.fc1`, the `txt_in` token refiner, the
final layer's (shift, scale) halves) and add:
- split q / k / v: `double_blocks.N.{img,txt}_attn_{q,k,v}` in HunyuanVideo 1.5's checkpoint and in
  musubi-tuner's and sd-scripts' models (their LoRAs), next to the fused `*_attn_qkv` of HunyuanImage 2.1's
  checkpoint and
  ComfyUI's model (`img_attn.qkv`, q | k | v thirds);
- HunyuanImage 2.1's tensor-parallel split of the single blocks (`linear1_{q,k,v,mlp}`, `linear2.fc`) next to
  the fused `linear1` (q | k | v | mlp);
- `byt5_in` (the glyph-text mapper: `context_embedder_2`), HunyuanVideo 1.5's `vision_in` (`image_embedder`,
  an MLP between two LayerNorms) and `cond_type_embedding`;
- the time embedder under `time_embed` (1.5) or `time_guidance_embed` (2.1, with the distilled guidance and
  MeanFlow `time_r_in` embedders).
Every name is registered in ComfyUI's spelling too (its `process_unet_state_dict` renames; hunyuan_video.py).
"""

from __future__ import annotations

from .hunyuan_video import (
    DOUBLE,
    FINAL,
    REFINER,
    SINGLE,
    hunyuan_from_comfy,
    video_patch_from_comfy,
    with_comfy_spellings,
)
from .record import Architecture, ComfyFacets, Layouts, Skeleton
from .spec import Alias, ArchTable

_D = "transformer_blocks.{i}"
_S = "single_transformer_blocks.{i}"


def _split_qkv(stream: str, targets: tuple[str, str, str]) -> tuple[Alias, ...]:
    return tuple(
        Alias(f"double_blocks.{{i}}.{stream}_attn_{p}", (f"{_D}.attn.{t}",))
        for p, t in zip("qkv", targets, strict=True)
    )


def _embedder(original: str, live: str) -> tuple[Alias, ...]:
    return (
        Alias(f"{original}.mlp.0", (f"{live}.linear_1",)),
        Alias(f"{original}.mlp.2", (f"{live}.linear_2",)),
    )


_BYT5 = (
    Alias("byt5_in.layernorm", ("context_embedder_2.norm",)),
    Alias("byt5_in.fc1", ("context_embedder_2.linear_1",)),
    Alias("byt5_in.fc2", ("context_embedder_2.linear_2",)),
    Alias("byt5_in.fc3", ("context_embedder_2.linear_3",)),
)
_SHARED = (
    *DOUBLE,
    *_split_qkv("img", ("to_q", "to_k", "to_v")),
    *_split_qkv("txt", ("add_q_proj", "add_k_proj", "add_v_proj")),
    *REFINER,
    *FINAL,
    *_BYT5,
)

HUNYUAN_VIDEO_15_TABLE = ArchTable(
    name="hunyuan-video-1.5",
    classes=("HunyuanVideo15Transformer3DModel",),
    aliases=with_comfy_spellings(
        (
            *_SHARED,
            *_embedder("time_in", "time_embed.timestep_embedder"),
            *_embedder("time_r_in", "time_embed.timestep_embedder_r"),  # MeanFlow (distilled) releases
            Alias("vision_in.proj.0", ("image_embedder.norm_in",)),
            Alias("vision_in.proj.1", ("image_embedder.linear_1",)),
            Alias("vision_in.proj.3", ("image_embedder.linear_2",)),
            Alias("vision_in.proj.4", ("image_embedder.norm_out",)),
            Alias("cond_type_embedding", ("cond_type_embed",)),
        )
    ),
)
HUNYUAN_IMAGE_21_TABLE = ArchTable(
    name="hunyuan-image-2.1",
    classes=("HunyuanImageTransformer2DModel",),
    aliases=with_comfy_spellings(
        (
            *_SHARED,
            *SINGLE,
            # The official code's tensor-parallel split of the single blocks (diffusers' script undoes it).
            *(
                Alias(f"single_blocks.{{i}}.linear1_{p}", (f"{_S}.{t}",))
                for p, t in (("q", "attn.to_q"), ("k", "attn.to_k"), ("v", "attn.to_v"), ("mlp", "proj_mlp"))
            ),
            Alias("single_blocks.{i}.linear2.fc", (f"{_S}.proj_out",)),
            *_embedder("time_in", "time_guidance_embed.timestep_embedder"),
            *_embedder("guidance_in", "time_guidance_embed.guidance_embedder"),  # guidance-distilled
            *_embedder("time_r_in", "time_guidance_embed.timestep_embedder_r"),  # MeanFlow-distilled
        )
    ),
)

_CHECKED = (
    "hand row map from diffusers' repo scripts convert_hunyuan_video1_5_to_diffusers.py / "
    "convert_hunyuan_image_to_diffusers.py (not installed), checked on ComfyUI's own model in fp64"
)


def _hunyuan_15_21_from_comfy(cfg: dict) -> dict:
    # ComfyUI's glyph mapper (`byt5_in`) always reads 1472-wide ByT5 states.
    return {
        **hunyuan_from_comfy(cfg),
        "qk_norm": "rms_norm",
        "text_embed_2_dim": 1472 if cfg.get("byt5") else None,
        "use_meanflow": bool(cfg.get("meanflow", False)),
    }


def _hunyuan_video_15_from_comfy(cfg: dict) -> dict:
    return {
        **_hunyuan_15_21_from_comfy(cfg),
        **video_patch_from_comfy(cfg, (1, 1, 1)),
        "image_embed_dim": cfg.get("vision_in_dim") or 1152,
    }


def _hunyuan_image_21_from_comfy(cfg: dict) -> dict:
    return {
        **_hunyuan_15_21_from_comfy(cfg),
        "patch_size": tuple(cfg.get("patch_size", (1, 1))),
        "num_single_layers": cfg["depth_single_blocks"],
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }


# HunyuanImage 2.1: named by the MMDiT hidden width (28 heads x 128).
HUNYUAN_IMAGE_21 = Architecture(
    "hunyuan-image-2.1",
    (HUNYUAN_IMAGE_21_TABLE,),
    label="HunyuanImage 2.1",
    skeleton=Skeleton(
        "transformer",
        "HunyuanImageTransformer2DModel",
        {},
        {},
        "HunyuanImageTransformer2DModel defaults (20 double / 40 single blocks, 28 heads x 128)",
    ),
    cli_names=("hunyuanimage-2.1",),
    layouts=Layouts(
        "hunyuan-image-2.1",
        "Tencent names (fused *_attn_qkv / linear1; split *_attn_q/k/v, the official linear1_q/k/v/mlp and "
        "linear2.fc), ComfyUI renames, sd-scripts (lora_unet_)",
        _CHECKED,
        "test_comfy_arch_names.py::test_*hunyuan*",
    ),
    comfy=ComfyFacets(
        ("HunyuanImage21", "HunyuanImage21Refiner"),
        _hunyuan_image_21_from_comfy,
        skeleton="hunyuan-image-2.1",
    ),
)
# HunyuanVideo 1.5: named by the MMDiT hidden width (16 heads x 128).
HUNYUAN_VIDEO_15 = Architecture(
    "hunyuan-video-1.5",
    (HUNYUAN_VIDEO_15_TABLE,),
    label="HunyuanVideo 1.5",
    skeleton=Skeleton(
        "transformer",
        "HunyuanVideo15Transformer3DModel",
        {},
        {},
        "HunyuanVideo15Transformer3DModel defaults (54 blocks, 16 heads x 128)",
    ),
    cli_names=("hunyuanvideo-1.5",),
    layouts=Layouts(
        "hunyuan-video-1.5",
        "Tencent names (split *_attn_q/k/v; fused *_attn_qkv as ComfyUI loads it), ComfyUI renames, "
        "musubi-tuner (lora_unet_)",
        _CHECKED,
        "test_comfy_arch_names.py::test_*hunyuan*",
    ),
    comfy=ComfyFacets(
        ("HunyuanVideo15", "HunyuanVideo15_SR_Distilled"),
        _hunyuan_video_15_from_comfy,
        skeleton="hunyuan-video-1.5",
    ),
)
