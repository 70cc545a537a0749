"""Architecture name -> full-size model skeleton on the `meta` device (no weights), for coverage checks.

Each entry is a diffusers class plus the few config numbers that set its shapes (taken from the released
configs), and the text encoders a kohya file for that architecture may target (transformers config classes)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger("loraweave")

_CLIP_L = (
    "CLIPTextModel",
    dict(
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        num_hidden_layers=12,
        projection_dim=768,
        hidden_act="quick_gelu",
    ),
)
_CLIP_H = (
    "CLIPTextModel",
    dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=23,
        projection_dim=512,
        hidden_act="gelu",
    ),
)
_CLIP_G = (
    "CLIPTextModelWithProjection",
    dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_attention_heads=20,
        num_hidden_layers=32,
        projection_dim=1280,
        hidden_act="gelu",
    ),
)
_T5_XXL = (
    "T5EncoderModel",
    dict(
        d_model=4096,
        d_ff=10240,
        d_kv=64,
        num_heads=64,
        num_layers=24,
        feed_forward_proj="gated-gelu",
        vocab_size=32128,
    ),
)

_SD15_UNET = dict(
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768,
    attention_head_dim=8,
    layers_per_block=2,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
)
_SDXL_UNET = dict(
    block_out_channels=[320, 640, 1280],
    cross_attention_dim=2048,
    attention_head_dim=[5, 10, 20],
    transformer_layers_per_block=[1, 2, 10],
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    layers_per_block=2,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
)
_FLUX = dict(
    attention_head_dim=128,
    guidance_embeds=True,
    in_channels=64,
    joint_attention_dim=4096,
    num_attention_heads=24,
    num_layers=19,
    num_single_layers=38,
    patch_size=1,
    pooled_projection_dim=768,
)

# Cosmos-Predict2-2B, the DiT Anima reuses (hidden 2048, 28 blocks, 1024-wide text embeddings, no learnable pos).
_ANIMA_DIT = dict(
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=28,
    text_embed_dim=1024,
    rope_scale=[1.0, 4.0, 4.0],
    extra_pos_embed_type=None,
)
_QWEN3_06B = (
    "Qwen3Model",
    dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
)


@dataclass(frozen=True)
class ArchEntry:
    name: str
    denoiser: str  # component name diffusers pipelines use ("unet" / "transformer")
    cls: str  # diffusers class
    config: dict
    text_encoders: dict[str, tuple[str, dict]] = field(
        default_factory=dict
    )  # component -> (transformers cls, cfg)
    source: str = ""
    # Other diffusers components the file's denoiser keys may target (Anima's LLM adapter): component -> (cls, cfg).
    components: dict[str, tuple[str, dict]] = field(default_factory=dict)


# Architectures built from their diffusers class defaults (no released config in realdata/configs to read instead;
# the defaults are the sizes the table tests check, e.g. Lumina-Image-2.0's 2304 hidden, Sana 1600M).
_DEFAULTS_ENTRIES = tuple(
    ArchEntry(name, "transformer", cls, {}, {}, f"{cls} defaults ({what})")
    for name, cls, what in (
        ("minimax-h3", "MiniMaxH3Transformer3DModel", "50 blocks, hidden 5376, 2 refiner blocks"),
        ("ideogram4", "Ideogram4Transformer2DModel", "34 layers, 18 heads x 256"),
        ("qwen-image-2.1", "QwenImage21Transformer2DModel", "32 blocks, 32 heads x 128"),
        ("lumina2", "Lumina2Transformer2DModel", "Lumina-Image-2.0: 26 layers, hidden 2304"),
        ("sana", "SanaTransformer2DModel", "Sana 1600M: 20 blocks, hidden 2240"),
        ("ltx2", "LTX2VideoTransformer3DModel", "LTX-2: 48 blocks, hidden 4096, audio tower"),
        ("ltx-video", "LTXVideoTransformer3DModel", "LTX-Video 0.9 2B: 28 blocks, hidden 2048"),
        ("pixart", "PixArtTransformer2DModel", "PixArt-alpha/Sigma: 28 blocks, hidden 1152"),
        ("ernie-image", "ErnieImageTransformer2DModel", "24 layers, hidden 3072"),
        ("kandinsky5", "Kandinsky5Transformer3DModel", "32 visual / 2 text blocks, dim 2048"),
        ("hunyuan-video-1.5", "HunyuanVideo15Transformer3DModel", "54 blocks, 16 heads x 128"),
        (
            "hunyuan-image-2.1",
            "HunyuanImageTransformer2DModel",
            "20 double / 40 single blocks, 28 heads x 128",
        ),
    )
)

CATALOG: dict[str, ArchEntry] = {
    e.name: e
    for e in (
        ArchEntry(
            "sd1", "unet", "UNet2DConditionModel", _SD15_UNET, {"text_encoder": _CLIP_L}, "sd15 unet config"
        ),
        ArchEntry(
            "sd2",
            "unet",
            "UNet2DConditionModel",
            {
                **_SD15_UNET,
                "cross_attention_dim": 1024,
                "attention_head_dim": [5, 10, 20, 20],
                "use_linear_projection": True,
            },
            {"text_encoder": _CLIP_H},
            "sd15 config with SD2 attention",
        ),
        ArchEntry(
            "sdxl",
            "unet",
            "UNet2DConditionModel",
            _SDXL_UNET,
            {"text_encoder": _CLIP_L, "text_encoder_2": _CLIP_G},
            "sdxl-base unet config",
        ),
        ArchEntry(
            "sdxl-refiner",
            "unet",
            "UNet2DConditionModel",
            {
                **_SDXL_UNET,
                "block_out_channels": [384, 768, 1536, 1536],
                "cross_attention_dim": 1280,
                "attention_head_dim": [6, 12, 24, 24],
                "transformer_layers_per_block": 4,
                "projection_class_embeddings_input_dim": 2560,
                "down_block_types": [
                    "DownBlock2D",
                    "CrossAttnDownBlock2D",
                    "CrossAttnDownBlock2D",
                    "DownBlock2D",
                ],
                "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
            },
            {"text_encoder_2": _CLIP_G},
            "sdxl-refiner unet config",
        ),
        ArchEntry(
            "flux",
            "transformer",
            "FluxTransformer2DModel",
            _FLUX,
            {"text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL},
            "flux1-dev transformer config",
        ),
        ArchEntry(
            "flux-schnell",
            "transformer",
            "FluxTransformer2DModel",
            {**_FLUX, "guidance_embeds": False},
            {"text_encoder": _CLIP_L, "text_encoder_2": _T5_XXL},
            "flux1-schnell transformer config",
        ),
        ArchEntry(
            "chroma",
            "transformer",
            "ChromaTransformer2DModel",
            dict(
                approximator_hidden_dim=5120,
                approximator_layers=5,
                attention_head_dim=128,
                axes_dims_rope=[16, 56, 56],
                in_channels=64,
                joint_attention_dim=4096,
                num_attention_heads=24,
                num_layers=19,
                num_single_layers=38,
                patch_size=1,
            ),
            {"text_encoder": _T5_XXL},
            "chroma transformer config",
        ),
        ArchEntry(
            "flux2", "transformer", "Flux2Transformer2DModel", {}, {}, "Flux2Transformer2DModel defaults"
        ),
        ArchEntry(
            "flux2-klein-4b",
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
        ArchEntry(
            "flux2-klein-9b",
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
        ArchEntry(
            "sd3",
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
            {"text_encoder": _CLIP_L, "text_encoder_2": _CLIP_G, "text_encoder_3": _T5_XXL},
            "sd3-medium transformer config",
        ),
        ArchEntry(
            "z-image",
            "transformer",
            "ZImageTransformer2DModel",
            dict(
                all_f_patch_size=[1],
                all_patch_size=[2],
                axes_dims=[32, 48, 48],
                axes_lens=[1536, 512, 512],
                cap_feat_dim=2560,
                dim=3840,
                in_channels=16,
                n_heads=30,
                n_kv_heads=30,
                n_layers=30,
                n_refiner_layers=2,
                qk_norm=True,
            ),
            {},
            "z-image-turbo transformer config",
        ),
        ArchEntry(
            "qwen-image",
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
        ArchEntry(
            "wan",
            "transformer",
            "WanTransformer3DModel",
            dict(
                added_kv_proj_dim=None,
                attention_head_dim=128,
                cross_attn_norm=True,
                eps=1e-6,
                ffn_dim=13824,
                freq_dim=256,
                in_channels=16,
                num_attention_heads=40,
                num_layers=40,
                out_channels=16,
                patch_size=[1, 2, 2],
                qk_norm="rms_norm_across_heads",
                text_dim=4096,
            ),
            {},
            "Wan2.1 T2V 14B config",
        ),
        ArchEntry(
            "wan-animate",
            "transformer",
            "WanAnimateTransformer3DModel",
            dict(
                added_kv_proj_dim=5120,
                image_dim=1280,
                in_channels=36,
                num_attention_heads=40,
                num_layers=40,
                ffn_dim=13824,
                text_dim=4096,
                inject_face_latents_blocks=5,
            ),
            {},
            "Wan2.2-Animate-14B config (diffusers conversion script)",
        ),
        ArchEntry(
            "wan-animate-2",
            "transformer",
            "WanAnimate2Transformer3DModel",
            {},
            {},
            "WanAnimate2Transformer3DModel defaults (14B: dim 5120, 40 blocks)",
        ),
        ArchEntry(
            "hunyuan-video",
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
            {"text_encoder_2": _CLIP_L},
            "HunyuanVideo T2V config",
        ),
        ArchEntry(
            "krea2", "transformer", "Krea2Transformer2DModel", {}, {}, "Krea2Transformer2DModel defaults"
        ),
        *_DEFAULTS_ENTRIES,
        ArchEntry(
            "ltx2.3",
            "transformer",
            "LTX2VideoTransformer3DModel",
            dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True),
            {},
            "LTX2VideoTransformer3DModel defaults plus LTX-2.3's attention gates and cross-attention modulation",
        ),
        ArchEntry(
            "anima",
            "transformer",
            "CosmosTransformer3DModel",
            _ANIMA_DIT,
            {"text_encoder": _QWEN3_06B},
            "Cosmos-Predict2-2B DiT config (Anima's), AnimaTextConditioner defaults, Qwen3-0.6B encoder",
            {"text_conditioner": ("AnimaTextConditioner", {})},
        ),
    )
}
# Names detection or users may give -> catalog name.
ALIASES = {
    "unet": "sd1",
    "sd15": "sd1",
    "sd1.5": "sd1",
    "sd21": "sd2",
    "flux1": "flux",
    "flux-dev": "flux",
    "zimage": "z-image",
    "sd3.5": "sd3",
    "hunyuan": "hunyuan-video",
    "qwen": "qwen-image",
    "krea-2": "krea2",
    "krea": "krea2",
    "minimax": "minimax-h3",
    "qwen-image-21": "qwen-image-2.1",
    "qwenimage21": "qwen-image-2.1",
    "lumina": "lumina2",
    "ltx-2": "ltx2",
    "ltx-2.3": "ltx2.3",
    "ernie": "ernie-image",
    "kandinsky-5": "kandinsky5",
    "hunyuanvideo-1.5": "hunyuan-video-1.5",
    "hunyuanimage-2.1": "hunyuan-image-2.1",
    "ltxv": "ltx-video",
    "ltx-video-2b": "ltx-video",
    "pixart-sigma": "pixart",
    "pixart-alpha": "pixart",
}


def canonical(name: str) -> str:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in CATALOG:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(sorted(CATALOG))}")
    return key


def _build_text_encoder(cls_name: str, cfg: dict) -> torch.nn.Module:
    import transformers

    config_cls = {
        "CLIPTextModel": "CLIPTextConfig",
        "CLIPTextModelWithProjection": "CLIPTextConfig",
        "T5EncoderModel": "T5Config",
        "Qwen3Model": "Qwen3Config",
    }[cls_name]
    config = getattr(transformers, config_cls)(**cfg)
    return getattr(transformers, cls_name)(config)


def build_meta(name: str, text_encoders: bool = True) -> dict[str, torch.nn.Module]:
    """{component name: module on the meta device}; full size, no memory for weights."""
    try:
        import diffusers
    except ImportError as exc:  # an optional extra: say how to get it instead of a traceback
        raise ValueError(
            f"building the {name} architecture needs diffusers (pip install 'loraweave[diffusers]'); "
            "or pass --model CHECKPOINT"
        ) from exc

    entry = CATALOG[canonical(name)]
    t0 = time.perf_counter()
    out: dict[str, torch.nn.Module] = {}
    with torch.device("meta"):
        out[entry.denoiser] = getattr(diffusers, entry.cls).from_config(entry.config)
        for comp, (cls_name, cfg) in entry.components.items():
            out[comp] = getattr(diffusers, cls_name).from_config(cfg)
        if text_encoders:
            for comp, (cls_name, cfg) in entry.text_encoders.items():
                out[comp] = _build_text_encoder(cls_name, cfg)
    log.info(
        "catalog build arch=%s components=%s seconds=%.3f",
        entry.name,
        ",".join(out),
        time.perf_counter() - t0,
    )
    return out
