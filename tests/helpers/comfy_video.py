"""Tiny Wan 2.2 (TI2V 5B, A14B experts), Wan Animate, HiDream, LTX-Video 0.9 and PixArt Sigma / Alpha models
built the way ComfyUI loads them, each with its diffusers twin (helpers.comfy_dits.DitModel).

Each starts from a seeded state dict in the architecture's original names at tiny widths (the shapes of
ComfyUI's own model class), goes through ComfyUI's detection and load (`comfy_dits._load`); widths that
detection hard-codes (HiDream: all of them; PixArt: hidden 1152 and 16 heads; LTX-Video: 32 heads) are set in
unet_config, as for Chroma. The twin holds the same weights through diffusers' single-file converter (Wan, Wan
Animate, LTX-Video, HiDream: the identity but for the prefix); PixArt has no diffusers single-file converter,
so its row map is ComfyUI's own `comfy.utils.pixart_to_diffusers` (what ComfyUI's LoRA key map uses: fused
`attn.qkv` and `cross_attn.kv_linear` split by rows), checked against an fp64 formula in the tests."""

from __future__ import annotations

import torch

from .comfy_dits import DitModel, _build, _meta_state
from .comfy_env import import_comfy
from .comfy_models import rows_of

# Wan: ComfyUI reads dim, ffn, depth and the in/out widths from the file and sets heads = dim // 128.
WAN_COMMON = dict(dim=128, ffn_dim=256, num_layers=2, num_heads=1, text_dim=4096, freq_dim=256)
WAN_TWIN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=1,
    attention_head_dim=128,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=256,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)


def _wan(name: str, in_dim: int, out_dim: int, expect: str, seed: int) -> DitModel:
    import_comfy()
    import comfy.ldm.wan.model
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    shapes = _meta_state(
        comfy.ldm.wan.model.WanModel, model_type="t2v", in_dim=in_dim, out_dim=out_dim, **WAN_COMMON
    )
    twin = {**WAN_TWIN, "in_channels": in_dim, "out_channels": out_dim}
    return _build(
        name, shapes, expect, {}, convert_wan_transformer_to_diffusers, ("WanTransformer3DModel", twin), seed
    )


def tiny_wan22_5b(seed: int = 0) -> DitModel:
    """Wan 2.2 TI2V 5B: 48 latent channels in and out (ComfyUI's WAN22_T2V, detected by the 48-wide head)."""
    return _wan("wan22-5b", 48, 48, "WAN22_T2V", seed)


def tiny_wan22_expert(seed: int) -> DitModel:
    """One Wan 2.2 I2V A14B noise expert: Wan 2.1's layout with 36 input channels and no image
    cross-attention; ComfyUI loads the high- and low-noise experts as two MODELs (two UNETLoader nodes),
    detected as WAN21_T2V."""
    return _wan(f"wan22-14b-{seed}", 36, 16, "WAN21_T2V", seed)


# Wan Animate: ComfyUI's AnimateWanModel is Wan I2V (image cross-attention, 1280-wide CLIP features) plus the
# face adapter (a fuser block every 5 blocks), face encoder (1024 x 4 heads) and motion encoder (512 px, style
# 512).
WAN_ANIMATE_TWIN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=1,
    attention_head_dim=128,
    in_channels=36,
    latent_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=256,
    num_layers=5,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    image_dim=1280,
    added_kv_proj_dim=128,
    face_encoder_hidden_dim=1024,
    face_encoder_num_heads=4,
    inject_face_latents_blocks=5,
)


def tiny_wan_animate(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.wan.model_animate as animate
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    shapes = _meta_state(animate.AnimateWanModel, in_dim=36, out_dim=16, **{**WAN_COMMON, "num_layers": 5})

    def convert(original: dict) -> dict:
        # The motion encoder's blur kernels are fixed buffers ComfyUI stores and diffusers computes.
        out = convert_wan_transformer_to_diffusers(original)
        return {k: v for k, v in out.items() if not k.endswith(".kernel")}

    return _build(
        "wan-animate",
        shapes,
        "WAN22_Animate",
        {},
        convert,
        ("WanAnimateTransformer3DModel", WAN_ANIMATE_TWIN),
        seed,
    )


# LTX-Video 0.9: detection reads the depth and, from attn2.to_k, heads of (rows // 32) at 32 heads and the
# cross-attention width; the latent and caption widths are the class's keyword arguments.
LTXV_WIDTHS = {"in_channels": 16, "caption_channels": 32}
LTXV_PARAMS = dict(
    cross_attention_dim=128, attention_head_dim=4, num_attention_heads=32, num_layers=2, **LTXV_WIDTHS
)


def tiny_ltx_video(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.lightricks.model as ltx
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

    twin = dict(
        in_channels=16,
        out_channels=16,
        num_attention_heads=32,
        attention_head_dim=4,
        cross_attention_dim=128,
        num_layers=2,
        caption_channels=32,
    )
    shapes = _meta_state(ltx.LTXVModel, **LTXV_PARAMS)
    return _build(
        "ltx-video",
        shapes,
        "LTXV",
        LTXV_WIDTHS,
        convert_ltx_transformer_checkpoint_to_diffusers,
        ("LTXVideoTransformer3DModel", twin),
        seed,
    )


# HiDream: detection hard-codes every width (and the MoE shape); the tiny ones are unet_config entries.
# ComfyUI's caption projections: one per block of the Llama width, then the T5 one.
HIDREAM_WIDTHS = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=32,
    num_attention_heads=2,
    caption_channels=[32, 24],
    text_emb_dim=32,
    num_routed_experts=4,
    num_activated_experts=2,
    axes_dims_rope=[16, 8, 8],
    max_resolution=[16, 16],
    llama_layers=[0, 1],
)


def tiny_hidream(seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.hidream.model as hidream
    from diffusers.loaders.single_file_utils import convert_hidream_transformer_to_diffusers

    shapes = _meta_state(hidream.HiDreamImageTransformer2DModel, **HIDREAM_WIDTHS)
    return _build(
        "hidream",
        shapes,
        "HiDream",
        HIDREAM_WIDTHS,
        convert_hidream_transformer_to_diffusers,
        ("HiDreamImageTransformer2DModel", dict(HIDREAM_WIDTHS)),
        seed,
    )


# PixArt: detection hard-codes hidden 1152 and 16 heads (and reads the depth, the caption length and, from
# ar_embedder, Alpha's micro-conditioning); hidden 96 = 2 heads of 48 (the size embedders take hidden // 3). A
# file without pos_embed leaves pe_interpolation unset, which the forward then rounds to 0 on a tiny latent.
PIXART_WIDTHS = {"hidden_size": 96, "num_heads": 2, "caption_channels": 32, "pe_interpolation": 1.0}


def _pixart_convert(hidden: int, depth: int, alpha: bool):
    """Original (ComfyUI) PixArt names -> diffusers, by ComfyUI's own pixart_to_diffusers rows; diffusers
    keeps the null caption (`y_embedder.y_embedding`) out of the transformer, and Sigma has no size
    embedders."""
    c = import_comfy()
    rows = c.utils.pixart_to_diffusers({"depth": depth, "hidden_size": hidden})
    dropped = ("caption_projection.y_embedding",) + (
        () if alpha else ("adaln_single.emb.resolution_embedder.", "adaln_single.emb.aspect_ratio_embedder.")
    )

    def run(original: dict) -> dict:
        return {
            name: rows_of(original, where).clone()
            for name, where in rows.items()
            if not name.startswith(dropped)
        }

    return run


def tiny_pixart(alpha: bool, seed: int = 0) -> DitModel:
    import_comfy()
    import comfy.ldm.pixart.pixartms as pixart
    import comfy.ops

    # On the CPU (its drop-path schedule reads a tensor's value), weights left uninitialised: only shapes are
    # used.
    shapes = pixart.PixArtMS(
        operations=comfy.ops.disable_weight_init,
        input_size=8,
        patch_size=2,
        in_channels=4,
        depth=2,
        model_max_length=8,
        micro_condition=alpha,
        **PIXART_WIDTHS,
    ).state_dict()
    twin = dict(
        num_attention_heads=2,
        attention_head_dim=48,
        in_channels=4,
        out_channels=8,
        num_layers=2,
        cross_attention_dim=96,
        sample_size=8,
        caption_channels=32,
        use_additional_conditions=alpha,
    )
    expect = "PixArtAlpha" if alpha else "PixArtSigma"
    return _build(
        "pixart-alpha" if alpha else "pixart-sigma",
        shapes,
        expect,
        PIXART_WIDTHS,
        _pixart_convert(96, 2, alpha),
        ("PixArtTransformer2DModel", twin),
        seed,
    )


VIDEO_BUILDERS = {
    "wan22-5b": tiny_wan22_5b,
    "wan-animate": tiny_wan_animate,
    "ltx-video": tiny_ltx_video,
    "hidream": tiny_hidream,
    "pixart-sigma": lambda: tiny_pixart(alpha=False),
    "pixart-alpha": lambda: tiny_pixart(alpha=True),
}


def _wan_forward(dm, in_dim: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, ctx = (torch.randn(s, generator=g) for s in ((1, in_dim, 1, 4, 4), (1, 5, 4096)))
    return dm(x, torch.tensor([0.5]), ctx)


def _wan_animate_forward(dm) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, ctx, clip = (torch.randn(s, generator=g) for s in ((1, 36, 2, 4, 4), (1, 5, 4096), (1, 257, 1280)))
    pose, face = (torch.randn(s, generator=g) for s in ((1, 16, 1, 4, 4), (1, 3, 1, 512, 512)))
    return dm(x, torch.tensor([0.5]), ctx, clip_fea=clip, pose_latents=pose, face_pixel_values=face)


def _ltxv_forward(dm) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, ctx = (torch.randn(s, generator=g) for s in ((1, 16, 2, 2, 2), (1, 5, 32)))
    return dm(x, torch.tensor([0.5]), ctx, None)


def _hidream_forward(dm) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x, pooled, t5, llama = (
        torch.randn(s, generator=g) for s in ((1, 16, 4, 4), (1, 32), (1, 5, 32), (1, 2, 5, 24))
    )
    return dm(x, torch.tensor([0.5]), y=pooled, context=t5, encoder_hidden_states_llama3=llama)


def _pixart_forward(dm) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    # 48 x 48: ComfyUI's position embedding takes its base size from the latent's size in steps of 64
    x, ctx = (torch.randn(s, generator=g) for s in ((1, 4, 48, 48), (1, 8, 32)))
    extra = {}
    if dm.micro_conditioning:
        extra = {"c_size": torch.tensor([[64.0, 64.0]]), "c_ar": torch.tensor([[1.0]])}
    return dm(x, torch.tensor([500.0]), ctx, **extra)


VIDEO_FORWARDS = {
    "wan22-5b": lambda dm: _wan_forward(dm, 48),
    "wan-animate": _wan_animate_forward,
    "ltx-video": _ltxv_forward,
    "hidream": _hidream_forward,
    "pixart-sigma": _pixart_forward,
    "pixart-alpha": _pixart_forward,
}
