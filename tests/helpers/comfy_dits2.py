"""Tiny HunyuanVideo 1.5, HunyuanImage 2.1, Kandinsky 5, ERNIE-Image, Anima and Cosmos-Predict2 models built
the way ComfyUI loads them, each with its diffusers twin (the second half of helpers.comfy_dits).

Each starts from a seeded state dict in the names ComfyUI's own model class has at tiny widths (shapes from
the class on `meta`), goes through ComfyUI's detection (`model_config_from_unet`, which must pick the expected
supported_models class), `process_unet_state_dict` and `load_model_weights`; the widths its detection does not
read (ERNIE-Image reads none, Kandinsky 5 no text widths, Cosmos no heads or depth below 2048) go into
unet_config. Row maps from ComfyUI's names to the twin's:
- HunyuanVideo 1.5 / HunyuanImage 2.1: diffusers installs no converter; `hunyuan_rows` is a hand map written
  here from the facts of diffusers' repo scripts (convert_hunyuan_video1_5_to_diffusers.py,
  convert_hunyuan_image_to_diffusers.py): fused qkv / linear1 chunked q | k | v (| mlp), the final layer's
  (shift, scale) halves swapped. It is independent of loraweave's tables (arch/hunyuan_video15.py), and the
  tests check both against a direct fp64 formula on ComfyUI's own tensors as well;
- Kandinsky 5, ERNIE-Image: the identity (the diffusers ports keep the original names; ERNIE's single-file
  converter only strips a prefix);
- Anima / Cosmos-Predict2: diffusers' `convert_cosmos_transformer_checkpoint_to_diffusers`. Anima's LLM
  adapter is a pipeline component of its own in diffusers: the map leaves it out and its keys are checked in
  fp64 alone. Its width is fixed in ComfyUI's class (a 32128 x 1024 embedding and six 1024-wide blocks, 130M
  parameters); the tiny model builds ComfyUI's own LLMAdapter class at small keyword widths."""

from __future__ import annotations

import contextlib
import functools
import re
from unittest import mock

import torch

from .comfy_dits import DitModel, _load, _meta_state, _twin
from .comfy_env import import_comfy
from .comfy_models import _seeded_shapes, tiny_clip


def _build_identity_named(
    name: str,
    cls,
    params: dict,
    expect: str,
    widths: dict,
    rows,
    twin: tuple[str, dict],
    seed: int,
    patch=None,
) -> DitModel:
    """A model whose seeded state dict is in ComfyUI's own names (ComfyUI renames none of them for these
    classes, which _load checks); `rows` maps ComfyUI names to the twin's; `patch` a context around every
    construction of ComfyUI's class."""
    c = import_comfy()
    patch = patch or contextlib.nullcontext
    with patch():
        original = _seeded_shapes(_meta_state(cls, **params), seed)
        patcher, originals = _load(c, dict(original), expect, widths)
    assert all(k == v for k, v in originals.items()), f"{expect}: ComfyUI renamed {originals}"
    model = _twin(*twin, rows({k: v.clone() for k, v in original.items()}))
    return DitModel(name, patcher, tiny_clip("sd1"), model, originals, rows)


# --- HunyuanVideo 1.5 / HunyuanImage 2.1: ComfyUI's HunyuanVideo class
# ---------------------------------------------

# ComfyUI module name -> diffusers module name, in ComfyUI's spelling; `{i}` blocks. Fused rows are split
# below.
_HY_WHOLE = {
    "img_in.proj": "x_embedder.proj",
    "txt_in.input_embedder": "context_embedder.proj_in",
    "txt_in.t_embedder.in_layer": "context_embedder.time_text_embed.timestep_embedder.linear_1",
    "txt_in.t_embedder.out_layer": "context_embedder.time_text_embed.timestep_embedder.linear_2",
    "txt_in.c_embedder.in_layer": "context_embedder.time_text_embed.text_embedder.linear_1",
    "txt_in.c_embedder.out_layer": "context_embedder.time_text_embed.text_embedder.linear_2",
    "txt_in.individual_token_refiner.blocks.{i}.norm1": (
        "context_embedder.token_refiner.refiner_blocks.{i}.norm1"
    ),
    "txt_in.individual_token_refiner.blocks.{i}.norm2": (
        "context_embedder.token_refiner.refiner_blocks.{i}.norm2"
    ),
    "txt_in.individual_token_refiner.blocks.{i}.self_attn.proj": (
        "context_embedder.token_refiner.refiner_blocks.{i}.attn.to_out.0"
    ),
    "txt_in.individual_token_refiner.blocks.{i}.mlp.0": (
        "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.0.proj"
    ),
    "txt_in.individual_token_refiner.blocks.{i}.mlp.2": (
        "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.2"
    ),
    "txt_in.individual_token_refiner.blocks.{i}.adaLN_modulation.1": (
        "context_embedder.token_refiner.refiner_blocks.{i}.norm_out.linear"
    ),
    "byt5_in.layernorm": "context_embedder_2.norm",
    "byt5_in.fc1": "context_embedder_2.linear_1",
    "byt5_in.fc2": "context_embedder_2.linear_2",
    "byt5_in.fc3": "context_embedder_2.linear_3",
    "vision_in.proj.0": "image_embedder.norm_in",
    "vision_in.proj.1": "image_embedder.linear_1",
    "vision_in.proj.3": "image_embedder.linear_2",
    "vision_in.proj.4": "image_embedder.norm_out",
    "cond_type_embedding": "cond_type_embed",
    "double_blocks.{i}.img_mod.lin": "transformer_blocks.{i}.norm1.linear",
    "double_blocks.{i}.txt_mod.lin": "transformer_blocks.{i}.norm1_context.linear",
    "double_blocks.{i}.img_attn.proj": "transformer_blocks.{i}.attn.to_out.0",
    "double_blocks.{i}.txt_attn.proj": "transformer_blocks.{i}.attn.to_add_out",
    "double_blocks.{i}.img_attn.norm.query_norm": "transformer_blocks.{i}.attn.norm_q",
    "double_blocks.{i}.img_attn.norm.key_norm": "transformer_blocks.{i}.attn.norm_k",
    "double_blocks.{i}.txt_attn.norm.query_norm": "transformer_blocks.{i}.attn.norm_added_q",
    "double_blocks.{i}.txt_attn.norm.key_norm": "transformer_blocks.{i}.attn.norm_added_k",
    "double_blocks.{i}.img_mlp.0": "transformer_blocks.{i}.ff.net.0.proj",
    "double_blocks.{i}.img_mlp.2": "transformer_blocks.{i}.ff.net.2",
    "double_blocks.{i}.txt_mlp.0": "transformer_blocks.{i}.ff_context.net.0.proj",
    "double_blocks.{i}.txt_mlp.2": "transformer_blocks.{i}.ff_context.net.2",
    "single_blocks.{i}.linear2": "single_transformer_blocks.{i}.proj_out",
    "single_blocks.{i}.norm.query_norm": "single_transformer_blocks.{i}.attn.norm_q",
    "single_blocks.{i}.norm.key_norm": "single_transformer_blocks.{i}.attn.norm_k",
    "single_blocks.{i}.modulation.lin": "single_transformer_blocks.{i}.norm.linear",
    "final_layer.linear": "proj_out",
}
_HY_FUSED = {  # fused rows, top to bottom; None: the rest
    "txt_in.individual_token_refiner.blocks.{i}.self_attn.qkv": tuple(
        f"context_embedder.token_refiner.refiner_blocks.{{i}}.attn.to_{p}" for p in "qkv"
    ),
    "double_blocks.{i}.img_attn.qkv": tuple(f"transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv"),
    "double_blocks.{i}.txt_attn.qkv": tuple(f"transformer_blocks.{{i}}.attn.add_{p}_proj" for p in "qkv"),
    "single_blocks.{i}.linear1": (
        *(f"single_transformer_blocks.{{i}}.attn.to_{p}" for p in "qkv"),
        "single_transformer_blocks.{i}.proj_mlp",
    ),
}
# The time embedders sit elsewhere in each model.
_HY_TIME = {
    "hunyuan-video-1.5": {
        "time_in": "time_embed.timestep_embedder",
        "time_r_in": "time_embed.timestep_embedder_r",
    },
    "hunyuan-image-2.1": {
        "time_in": "time_guidance_embed.timestep_embedder",
        "guidance_in": "time_guidance_embed.guidance_embedder",
        "time_r_in": "time_guidance_embed.timestep_embedder_r",
    },
}


def _match(table: dict, module: str) -> tuple[object, str | None] | None:
    for pattern, target in table.items():
        m = re.fullmatch(re.escape(pattern).replace(r"\{i\}", r"(\d+)"), module)
        if m:
            return target, (m.group(1) if m.groups() else None)
    return None


def hunyuan_rows(kind: str, hidden: int):
    """ComfyUI HunyuanVideo-class state (its names) -> the diffusers HunyuanVideo 1.5 / HunyuanImage 2.1
    names."""
    time = {
        f"{o}.{a}": f"{t}.{b}"
        for o, t in _HY_TIME[kind].items()
        for a, b in (("in_layer", "linear_1"), ("out_layer", "linear_2"))
    }

    def run(state: dict) -> dict:
        out = {}
        for key, value in state.items():
            module, _, leaf = key.rpartition(".")
            fill = lambda t, i: t.replace("{i}", i) if i is not None else t  # noqa: E731
            if module in time:
                out[f"{time[module]}.{leaf}"] = value
            elif module == "final_layer.adaLN_modulation.1":  # (shift, scale) -> (scale, shift)
                shift, scale = value.chunk(2)
                out[f"norm_out.linear.{leaf}"] = torch.cat([scale, shift])
            elif (found := _match(_HY_WHOLE, module)) is not None:
                out[f"{fill(found[0], found[1])}.{leaf}"] = value
            elif (found := _match(_HY_FUSED, module)) is not None:
                targets, i = found
                sizes = [hidden] * 3 + ([len(value) - 3 * hidden] if len(targets) == 4 else [])
                for target, part in zip(targets, value.split(sizes), strict=True):
                    out[f"{fill(target, i)}.{leaf}"] = part
            else:
                raise KeyError(f"{kind}: no row map for ComfyUI's {key}")
        return out

    return run


def _hunyuan_params(**kw) -> dict:
    base = dict(
        in_channels=16,
        out_channels=16,
        vec_in_dim=None,
        context_in_dim=32,
        hidden_size=128,
        mlp_ratio=4.0,
        num_heads=1,
        depth=1,
        depth_single_blocks=0,
        axes_dim=[16, 56, 56],
        theta=256,
        patch_size=[1, 1, 1],
        qkv_bias=True,
        guidance_embed=False,
        byt5=True,
        meanflow=False,
        use_cond_type_embedding=False,
        vision_in_dim=None,
        meanflow_sum=False,
    )
    return {**base, **kw}


# HunyuanVideo 1.5: detection needs vision_in at 1152 (SigLIP) and reads the rest; 2 double blocks, no single
# ones.
HV15_PARAMS = _hunyuan_params(
    in_channels=65,
    out_channels=32,
    depth=2,
    use_cond_type_embedding=True,
    vision_in_dim=1152,
    meanflow_sum=True,
)


def tiny_hunyuan_video_15(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.hunyuan_video.model as hy

    twin = dict(
        in_channels=65,
        out_channels=32,
        num_attention_heads=1,
        attention_head_dim=128,
        num_layers=2,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=32,
        text_embed_2_dim=1472,
        image_embed_dim=1152,
        rope_theta=256.0,
        rope_axes_dim=(16, 56, 56),
    )
    return _build_identity_named(
        "hunyuan-video-1.5",
        hy.HunyuanVideo,
        HV15_PARAMS,
        "HunyuanVideo15",
        {},
        hunyuan_rows("hunyuan-video-1.5", 128),
        ("HunyuanVideo15Transformer3DModel", twin),
        seed,
    )


# HunyuanImage 2.1 (the distilled release: guidance and MeanFlow embedders): 2D patches, 1 double + 1 single
# block.
HI21_PARAMS = _hunyuan_params(
    in_channels=64,
    out_channels=64,
    depth_single_blocks=1,
    axes_dim=[64, 64],
    patch_size=[1, 1],
    guidance_embed=True,
    meanflow=True,
)


def tiny_hunyuan_image_21(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.hunyuan_video.model as hy

    twin = dict(
        in_channels=64,
        out_channels=64,
        num_attention_heads=1,
        attention_head_dim=128,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=2,
        mlp_ratio=4.0,
        patch_size=(1, 1),
        qk_norm="rms_norm",
        guidance_embeds=True,
        text_embed_dim=32,
        text_embed_2_dim=1472,
        rope_theta=256.0,
        rope_axes_dim=(64, 64),
        use_meanflow=True,
    )
    return _build_identity_named(
        "hunyuan-image-2.1",
        hy.HunyuanVideo,
        HI21_PARAMS,
        "HunyuanImage21",
        {},
        hunyuan_rows("hunyuan-image-2.1", 128),
        ("HunyuanImageTransformer2DModel", twin),
        seed,
    )


# Sibling releases on the same classes: HunyuanVideo 1.5's distilled super-resolution model (98 input
# channels, its own supported_models class) and HunyuanImage 2.1's refiner (3D patches, 128 in / 64 out, no
# glyph mapper).
def tiny_hunyuan_video_15_sr(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.hunyuan_video.model as hy

    twin = dict(
        in_channels=98,
        out_channels=32,
        num_attention_heads=1,
        attention_head_dim=128,
        num_layers=1,
        num_refiner_layers=2,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=32,
        text_embed_2_dim=1472,
        image_embed_dim=1152,
        rope_axes_dim=(16, 56, 56),
    )
    return _build_identity_named(
        "hunyuan-video-1.5-sr",
        hy.HunyuanVideo,
        {**HV15_PARAMS, "in_channels": 98, "depth": 1},
        "HunyuanVideo15_SR_Distilled",
        {},
        hunyuan_rows("hunyuan-video-1.5", 128),
        ("HunyuanVideo15Transformer3DModel", twin),
        seed,
    )


def tiny_hunyuan_image_21_refiner(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.hunyuan_video.model as hy

    params = _hunyuan_params(in_channels=128, out_channels=64, depth_single_blocks=1, byt5=False)
    twin = dict(
        in_channels=128,
        out_channels=64,
        num_attention_heads=1,
        attention_head_dim=128,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=2,
        patch_size=(1, 1, 1),
        text_embed_dim=32,
        rope_axes_dim=(16, 56, 56),
    )
    return _build_identity_named(
        "hunyuan-image-2.1-refiner",
        hy.HunyuanVideo,
        params,
        "HunyuanImage21Refiner",
        {},
        hunyuan_rows("hunyuan-image-2.1", 128),
        ("HunyuanImageTransformer2DModel", twin),
        seed,
    )


VARIANT_BUILDERS = {
    "hunyuan-video-1.5-sr": tiny_hunyuan_video_15_sr,
    "hunyuan-image-2.1-refiner": tiny_hunyuan_image_21_refiner,
}


# --- Kandinsky 5, ERNIE-Image: identity row maps
# -------------------------------------------------------------------


def identity_rows(state: dict) -> dict:
    return dict(state)


# Kandinsky 5 (Lite layout: image-conditioned visual input, (16 x 2 + 1) x 4 = 132 wide): detection reads the
# widths but not the text encoders'; heads of sum(axes_dims) = 64.
KANDINSKY5_WIDTHS = {"in_text_dim": 32, "in_text_dim2": 24}
KANDINSKY5_PARAMS = dict(
    in_visual_dim=16,
    out_visual_dim=16,
    time_dim=64,
    model_dim=128,
    ff_dim=256,
    visual_embed_dim=132,
    patch_size=(1, 2, 2),
    num_text_blocks=1,
    num_visual_blocks=2,
    axes_dims=(16, 24, 24),
    **KANDINSKY5_WIDTHS,
)


def tiny_kandinsky5(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.kandinsky5.model as k5

    twin = dict(
        in_visual_dim=16,
        in_text_dim=32,
        in_text_dim2=24,
        time_dim=64,
        out_visual_dim=16,
        patch_size=(1, 2, 2),
        model_dim=128,
        ff_dim=256,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(16, 24, 24),
        visual_cond=True,
    )
    return _build_identity_named(
        "kandinsky5",
        k5.Kandinsky5,
        KANDINSKY5_PARAMS,
        "Kandinsky5",
        KANDINSKY5_WIDTHS,
        identity_rows,
        ("Kandinsky5Transformer3DModel", twin),
        seed,
    )


# ERNIE-Image: detection writes no width at all (ComfyUI builds its class defaults, the released 4096 x 36).
ERNIE_WIDTHS = dict(
    hidden_size=128,
    num_attention_heads=2,
    num_layers=2,
    ffn_hidden_size=256,
    in_channels=16,
    out_channels=16,
    patch_size=1,
    text_in_dim=32,
    rope_axes_dim=(16, 24, 24),
)


def tiny_ernie_image(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.ernie.model as ernie

    return _build_identity_named(
        "ernie-image",
        ernie.ErnieImageModel,
        ERNIE_WIDTHS,
        "ErnieImage",
        ERNIE_WIDTHS,
        identity_rows,
        ("ErnieImageTransformer2DModel", ERNIE_WIDTHS),
        seed,
    )


# --- Anima / Cosmos-Predict2: ComfyUI's MiniTrainDIT
# ----------------------------------------------------------------

# Detection sets heads and depth only at 2048 / 5120 wide: at 128 they are unet_config.
COSMOS_WIDTHS = {"num_blocks": 2, "num_heads": 2}
COSMOS_PARAMS = dict(
    max_img_h=240,
    max_img_w=240,
    max_frames=128,
    in_channels=16,
    out_channels=16,
    patch_spatial=2,
    patch_temporal=1,
    concat_padding_mask=True,
    model_channels=128,
    mlp_ratio=4.0,
    crossattn_emb_channels=1024,
    pos_emb_cls="rope3d",
    pos_emb_learnable=True,
    pos_emb_interpolation="crop",
    min_fps=1,
    max_fps=30,
    use_adaln_lora=True,
    adaln_lora_dim=256,
    rope_h_extrapolation_ratio=4.0,
    rope_w_extrapolation_ratio=4.0,
    extra_per_block_abs_pos_emb=False,
    **COSMOS_WIDTHS,
)
COSMOS_TWIN = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=2,
    attention_head_dim=64,
    num_layers=2,
    mlp_ratio=4.0,
    text_embed_dim=1024,
    adaln_lora_dim=256,
    max_size=(128, 240, 240),
    patch_size=(1, 2, 2),
    rope_scale=(1.0, 4.0, 4.0),
    concat_padding_mask=True,
    extra_pos_embed_type=None,
)
LLM_ADAPTER_TINY = dict(source_dim=32, target_dim=32, model_dim=64, num_layers=1, num_heads=2)


def cosmos_rows(state: dict) -> dict:
    from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

    return convert_cosmos_transformer_checkpoint_to_diffusers(
        {k: v for k, v in state.items() if not k.startswith("llm_adapter.")}
    )


def _small_llm_adapter():
    import comfy.ldm.anima.model as anima

    return mock.patch.object(anima, "LLMAdapter", functools.partial(anima.LLMAdapter, **LLM_ADAPTER_TINY))


def tiny_anima(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.anima.model as anima

    return _build_identity_named(
        "anima",
        anima.Anima,
        {**COSMOS_PARAMS, "image_model": "anima"},
        "Anima",
        COSMOS_WIDTHS,
        cosmos_rows,
        ("CosmosTransformer3DModel", COSMOS_TWIN),
        seed,
        patch=_small_llm_adapter,
    )


def tiny_cosmos_predict2(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.cosmos.predict2 as predict2

    return _build_identity_named(
        "cosmos-predict2",
        predict2.MiniTrainDIT,
        COSMOS_PARAMS,
        "CosmosT2IPredict2",
        COSMOS_WIDTHS,
        cosmos_rows,
        ("CosmosTransformer3DModel", COSMOS_TWIN),
        seed,
    )


DIT2_BUILDERS = {
    "hunyuan-video-1.5": tiny_hunyuan_video_15,
    "hunyuan-image-2.1": tiny_hunyuan_image_21,
    "kandinsky5": tiny_kandinsky5,
    "ernie-image": tiny_ernie_image,
    "anima": tiny_anima,
    "cosmos-predict2": tiny_cosmos_predict2,
}
