"""Tiny SD3, Flux.2, Chroma and HunyuanVideo models built the way ComfyUI loads them, each with its diffusers
twin.

Each starts from a seeded state dict in the architecture's original names (the shapes of ComfyUI's own model
class at tiny widths, norms spelled as the released files spell them), goes through ComfyUI's detection
(`model_detection`), its `process_unet_state_dict` renames and `load_model_weights`, as
`comfy.sd.load_diffusion_model_state_dict` does; widths its detection hard-codes (Chroma's approximator) are
set in unet_config. The twin holds the same weights through diffusers' single-file converter.
`DitModel.as_diffusers` maps a ComfyUI state dict to the twin's names: ComfyUI's renames inverted (checked
against ComfyUI's own on every key), then the converter."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .comfy_env import import_comfy
from .comfy_models import ComfyModel, _seeded_shapes, tiny_clip


@dataclass
class DitModel(ComfyModel):
    originals: dict[str, str]  # ComfyUI state-dict name -> original (file) name
    convert: Callable[[dict], dict]  # original-named state dict -> diffusers names (the twin's)

    def as_diffusers(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.convert({self.originals[k]: v.clone() for k, v in state.items()})


def _load(c, original: dict, expect: str, widths: dict) -> tuple[object, dict[str, str]]:
    """ComfyUI's detection and load of an original-named state dict; also {ComfyUI name: original name}."""
    model_config = c.model_detection.model_config_from_unet(original, "")
    assert model_config is not None and type(model_config).__name__ == expect, (
        f"ComfyUI did not detect {expect}: {type(model_config).__name__}"
    )
    model_config.unet_config.update(widths)
    model_config.set_inference_dtype(torch.float32, None)
    tags = {k: torch.tensor([i]) for i, k in enumerate(original)}
    names = list(original)
    originals = {k: names[int(v)] for k, v in model_config.process_unet_state_dict(dict(tags)).items()}
    model = model_config.get_model({}, "")
    model.load_model_weights(model_config.process_unet_state_dict(dict(original)), "")
    patcher = c.model_patcher.ModelPatcher(
        model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )
    live = set(patcher.model.diffusion_model.state_dict())
    assert live == set(originals), f"{expect}: ComfyUI's names differ: {sorted(live ^ set(originals))[:6]}"
    return patcher, originals


def _padded(
    convert: Callable[[dict], dict],
    fused: str,
    sizes: tuple[int, ...],
    full: tuple[int, ...],
    cuts: dict[str, int],
):
    """`convert` for a converter that splits a fused tensor at full-size widths (Chroma's and HunyuanVideo's
    single-block `linear1` at 3072, Lumina 2's GQA qkv at 2304 | 768 | 768): the `fused` tensors' parts
    (`sizes` rows) are padded with zero rows to the `full` widths and the converted tensors cut back to
    `cuts[pattern]` rows, so the converter still decides every name and the row order."""

    def run(original: dict) -> dict:
        sd = dict(original)
        for key in [k for k in sd if re.fullmatch(fused, k)]:
            parts = sd[key].split(sizes)
            sd[key] = torch.cat(
                [
                    torch.cat([p, p.new_zeros((n - len(p), *p.shape[1:]))])
                    for p, n in zip(parts, full, strict=True)
                ]
            )
        out = convert(sd)
        for key in list(out):
            rows = next((n for pattern, n in cuts.items() if re.search(pattern, key)), None)
            if rows is not None:
                out[key] = out[key][:rows].clone()
        return out

    return run


def _linear1(convert: Callable[[dict], dict], hidden: int, mlp: int, full_mlp: int):
    return _padded(
        convert,
        r"single_blocks\.\d+\.linear1\.(weight|bias)",
        (hidden, hidden, hidden, mlp),
        (3072, 3072, 3072, full_mlp),
        {
            r"^single_transformer_blocks\.\d+\.attn\.to_[qkv]\.": hidden,
            r"^single_transformer_blocks\.\d+\.proj_mlp\.": mlp,
        },
    )


def _twin(cls_name: str, config: dict, state: dict) -> torch.nn.Module:
    import diffusers

    twin = getattr(diffusers, cls_name)(**config).eval()
    twin.load_state_dict(state)  # strict: the converter names every twin tensor, and nothing else
    return twin


def _build(
    name: str,
    shapes: dict,
    expect: str,
    widths: dict,
    convert,
    twin: tuple[str, dict],
    seed: int,
    bfl_norms: bool = False,
) -> DitModel:
    c = import_comfy()
    original = _seeded_shapes(shapes, seed)
    if bfl_norms:  # released BFL / Tencent files spell RMSNorm weights `.scale`
        original = {(k[: -len(".weight")] + ".scale" if _is_norm(k) else k): v for k, v in original.items()}
    patcher, originals = _load(c, dict(original), expect, widths)
    model = _twin(*twin, convert({k: v.clone() for k, v in original.items()}))
    return DitModel(name, patcher, tiny_clip("sd1"), model, originals, convert)


def _is_norm(key: str) -> bool:
    return key.endswith("_norm.weight") or bool(re.search(r"\.norms\.\d+\.weight$", key))


def _meta_state(cls, **kwargs) -> dict:
    import comfy.ops

    with torch.device("meta"):
        return cls(operations=comfy.ops.disable_weight_init, **kwargs).state_dict()


# SD3 (MMDiT): ComfyUI sets hidden = 64 * depth with depth heads of 64; block 0 has SD3.5's dual attention
# (attn2).
SD3_PARAMS = dict(
    in_channels=16,
    patch_size=2,
    depth=2,
    out_channels=16,
    adm_in_channels=32,
    context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 128}},
    pos_embed_max_size=8,
    num_patches=64,
    qk_norm="rms",
    x_block_self_attn_layers=[0],
    pos_embed_scaling_factor=None,
)


def tiny_sd3(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    twin = dict(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        num_layers=2,
        attention_head_dim=64,
        num_attention_heads=2,
        joint_attention_dim=32,
        caption_projection_dim=128,
        pooled_projection_dim=32,
        out_channels=16,
        pos_embed_max_size=8,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    shapes = _meta_state(mmdit.MMDiT, **SD3_PARAMS)
    return _build(
        "sd3",
        shapes,
        "SD3",
        {},
        convert_sd3_transformer_checkpoint_to_diffusers,
        ("SD3Transformer2DModel", twin),
        seed,
    )


# Flux.2: detection reads hidden from img_in and sets heads = hidden // 128, mlp_ratio 3, no biases.
FLUX2_PARAMS = dict(
    in_channels=128,
    out_channels=128,
    vec_in_dim=None,
    context_in_dim=32,
    hidden_size=128,
    mlp_ratio=3.0,
    num_heads=1,
    depth=2,
    depth_single_blocks=2,
    axes_dim=[32, 32, 32, 32],
    theta=2000,
    patch_size=1,
    qkv_bias=False,
    guidance_embed=True,
    txt_ids_dims=[3],
    global_modulation=True,
    mlp_silu_act=True,
    ops_bias=False,
    default_ref_method="index",
    ref_index_scale=10.0,
)


def tiny_flux2(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.flux.model
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    twin = dict(
        in_channels=128,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=128,
        num_attention_heads=1,
        joint_attention_dim=32,
        guidance_embeds=True,
    )
    shapes = _meta_state(comfy.ldm.flux.model.Flux, **FLUX2_PARAMS)
    return _build(
        "flux2",
        shapes,
        "Flux2",
        {},
        convert_flux2_transformer_checkpoint_to_diffusers,
        ("Flux2Transformer2DModel", twin),
        seed,
        bfl_norms=True,
    )


# Chroma: detection hard-codes the approximator (5 layers of 5120 to 3072); at hidden 128 it is set to 1 of 64
# to 128.
CHROMA_WIDTHS = {"out_dim": 128, "hidden_dim": 64, "n_layers": 1}
CHROMA_PARAMS = dict(
    in_channels=64,
    out_channels=64,
    context_in_dim=32,
    hidden_size=128,
    mlp_ratio=4.0,
    num_heads=1,
    depth=1,
    depth_single_blocks=1,
    axes_dim=[16, 56, 56],
    theta=10000,
    patch_size=2,
    qkv_bias=True,
    in_dim=64,
    txt_ids_dims=[],
    vec_in_dim=None,
    **CHROMA_WIDTHS,
)


def tiny_chroma(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.chroma.model
    from diffusers.loaders.single_file_utils import convert_chroma_transformer_checkpoint_to_diffusers

    twin = dict(
        in_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=1,
        joint_attention_dim=32,
        approximator_hidden_dim=64,
        approximator_layers=1,
    )
    shapes = _meta_state(comfy.ldm.chroma.model.Chroma, **CHROMA_PARAMS)
    convert = _linear1(convert_chroma_transformer_checkpoint_to_diffusers, 128, 512, full_mlp=4 * 3072)
    return _build(
        "chroma",
        shapes,
        "Chroma",
        CHROMA_WIDTHS,
        convert,
        ("ChromaTransformer2DModel", twin),
        seed,
        bfl_norms=True,
    )


# HunyuanVideo: detection sets heads = hidden // 128 and a 768-wide vector_in; the file has Tencent names.
HUNYUAN_PARAMS = dict(
    in_channels=16,
    out_channels=16,
    vec_in_dim=768,
    context_in_dim=32,
    hidden_size=128,
    mlp_ratio=4.0,
    num_heads=1,
    depth=1,
    depth_single_blocks=1,
    axes_dim=[16, 56, 56],
    theta=256,
    patch_size=[1, 2, 2],
    qkv_bias=True,
    guidance_embed=True,
    byt5=False,
    meanflow=False,
    use_cond_type_embedding=False,
    vision_in_dim=None,
    meanflow_sum=False,
)
# ComfyUI's HunyuanVideo.process_unet_state_dict renames, undone (tencent_name checks each against ComfyUI's).
_TENCENT = (
    ("txt_in.t_embedder.in_layer.", "txt_in.t_embedder.mlp.0."),
    ("txt_in.t_embedder.out_layer.", "txt_in.t_embedder.mlp.2."),
    ("txt_in.c_embedder.in_layer.", "txt_in.c_embedder.linear_1."),
    ("txt_in.c_embedder.out_layer.", "txt_in.c_embedder.linear_2."),
    ("_mod.lin.", "_mod.linear."),
    ("_attn.qkv.", "_attn_qkv."),
    ("_attn.proj.", "_attn_proj."),
    ("_attn.norm.query_norm.", "_attn_q_norm."),
    ("_attn.norm.key_norm.", "_attn_k_norm."),
    (".norm.query_norm.", ".q_norm."),
    (".norm.key_norm.", ".k_norm."),
    (".modulation.lin.", ".modulation.linear."),
    ("time_in.in_layer.", "time_in.mlp.0."),
    ("time_in.out_layer.", "time_in.mlp.2."),
    ("guidance_in.in_layer.", "guidance_in.mlp.0."),
    ("guidance_in.out_layer.", "guidance_in.mlp.2."),
)


def tencent_name(comfy_key: str) -> str:
    """The original name of a ComfyUI HunyuanVideo tensor or module name."""
    out = re.sub(r"mlp\.([02])\.", lambda m: f"mlp.fc{1 if m[1] == '0' else 2}.", comfy_key + ".")
    for new, old in _TENCENT:
        out = out.replace(new, old)
    return out[:-1]


def tiny_hunyuan_video(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.hunyuan_video.model
    from diffusers.loaders.single_file_utils import convert_hunyuan_video_transformer_to_diffusers

    twin = dict(
        in_channels=16,
        out_channels=16,
        num_attention_heads=1,
        attention_head_dim=128,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=2,
        text_embed_dim=32,
        pooled_projection_dim=768,
    )
    comfy_shapes = _meta_state(comfy.ldm.hunyuan_video.model.HunyuanVideo, **HUNYUAN_PARAMS)
    shapes = {tencent_name(k): v for k, v in comfy_shapes.items()}
    convert = _linear1(convert_hunyuan_video_transformer_to_diffusers, 128, 512, full_mlp=512)
    return _build(
        "hunyuan-video", shapes, "HunyuanVideo", {}, convert, ("HunyuanVideoTransformer3DModel", twin), seed
    )


# LTX-2 (ComfyUI's LTXAV): detection reads the depth and, from attn2.to_k, heads of (rows // 32) at 32 heads
# and the cross-attention width; audio tower, caption and text-connector widths are the class's keyword
# arguments.
LTX2_WIDTHS = dict(
    in_channels=16,
    audio_in_channels=128,
    audio_cross_attention_dim=64,
    audio_attention_head_dim=2,
    audio_num_attention_heads=32,
    caption_channels=32,
    connector_attention_head_dim=16,
    connector_num_attention_heads=2,
    connector_num_layers=1,
)
LTX2_PARAMS = dict(
    cross_attention_dim=128, attention_head_dim=4, num_attention_heads=32, num_layers=2, **LTX2_WIDTHS
)


def tiny_ltx2(seed: int = 0) -> DitModel:
    """LTX-2 (video + audio tower) at video width 128 and audio width 64; the text connectors (a pipeline
    component of their own in diffusers, which the converter drops) stay in ComfyUI's model."""
    import_comfy()
    import comfy.ldm.lightricks.av_model as av
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    twin = dict(
        in_channels=16,
        out_channels=16,
        num_attention_heads=32,
        attention_head_dim=4,
        cross_attention_dim=128,
        audio_in_channels=128,
        audio_out_channels=128,
        audio_num_attention_heads=32,
        audio_attention_head_dim=2,
        audio_cross_attention_dim=64,
        caption_channels=32,
        num_layers=2,
    )
    shapes = _meta_state(av.LTXAVModel, **LTX2_PARAMS)
    return _build(
        "ltx2",
        shapes,
        "LTXAV",
        LTX2_WIDTHS,
        convert_ltx2_transformer_to_diffusers,
        ("LTX2VideoTransformer3DModel", twin),
        seed,
    )


# Lumina 2: detection reads dim, cap_feat_dim and depth (heads and rope only at 2304); the rest are
# unet_config.
LUMINA2_WIDTHS = {
    "n_heads": 2,
    "n_kv_heads": 1,
    "axes_dims": [16, 24, 24],
    "axes_lens": [64, 32, 32],
    "rope_theta": 10000.0,
    "ffn_dim_multiplier": 4.0,
    "multiple_of": 256,
}


def tiny_lumina2(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.lumina.model
    from diffusers.loaders.single_file_utils import convert_lumina2_to_diffusers

    twin = dict(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        hidden_size=128,
        num_layers=1,
        num_refiner_layers=2,
        num_attention_heads=2,
        num_kv_heads=1,
        multiple_of=256,
        ffn_dim_multiplier=None,
        axes_dim_rope=(16, 24, 24),
        axes_lens=(64, 32, 32),
        cap_feat_dim=32,
    )
    shapes = _meta_state(
        comfy.ldm.lumina.model.NextDiT,
        patch_size=2,
        in_channels=16,
        dim=128,
        n_layers=1,
        cap_feat_dim=32,
        qk_norm=True,
        **LUMINA2_WIDTHS,
    )
    convert = _padded(
        convert_lumina2_to_diffusers,
        r".*attention\.qkv\.weight",
        (128, 64, 64),
        (2304, 768, 768),
        {r"attn\.to_q\.": 128, r"attn\.to_[kv]\.": 64},
    )
    return _build(
        "lumina2", shapes, "Lumina2", LUMINA2_WIDTHS, convert, ("Lumina2Transformer2DModel", twin), seed
    )


DIT_BUILDERS = {
    "sd3": tiny_sd3,
    "flux2": tiny_flux2,
    "chroma": tiny_chroma,
    "hunyuan-video": tiny_hunyuan_video,
    "ltx2": tiny_ltx2,
    "lumina2": tiny_lumina2,
}
