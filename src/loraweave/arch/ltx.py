"""LTX-Video and LTX-2 / 2.3: original (Lightricks, ComfyUI) names -> diffusers modules, by the converters'
renames.

Sources: diffusers `_convert_non_diffusers_ltx2_lora_to_diffusers` and `convert_ltx2_transformer_to_diffusers`
(LTX-2: audio tower, audio<->video cross-attention and its modulation, `adaln_single` -> `time_embed`,
`q_norm` -> `norm_q`, prompt modulation of 2.3), `_convert_non_diffusers_ltxv_lora_to_diffusers` (LTX-Video:
the names are already the diffusers ones, only the `diffusion_model.` prefix differs, which the key parser
strips). The text connectors are a pipeline component of their own (`connectors`); their original prefix is
`text_embedding_projection.` and `aggregate_embed` is diffusers' `text_proj_in`.
"""

from __future__ import annotations

from .record import Architecture, ComfyFacets, Layouts, Modalities, Skeleton
from .spec import ArchTable

LTX2 = ArchTable(
    name="ltx2",
    classes=("LTX2VideoTransformer3DModel",),
    aliases=(),
    renames=(
        ("patchify_proj", "proj_in"),
        ("audio_patchify_proj", "audio_proj_in"),
        ("av_ca_video_scale_shift_adaln_single", "av_cross_attn_video_scale_shift"),
        ("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate"),
        ("av_ca_audio_scale_shift_adaln_single", "av_cross_attn_audio_scale_shift"),
        ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"),
        ("scale_shift_table_a2v_ca_video", "video_a2v_cross_attn_scale_shift_table"),
        ("scale_shift_table_a2v_ca_audio", "audio_a2v_cross_attn_scale_shift_table"),
        ("q_norm", "norm_q"),
        ("k_norm", "norm_k"),
        ("audio_prompt_adaln_single", "audio_prompt_adaln"),
        ("prompt_adaln_single", "prompt_adaln"),
    ),
    prefix_renames=(("adaln_single.", "time_embed."), ("audio_adaln_single.", "audio_time_embed.")),
)

LTX2_CONNECTORS = ArchTable(
    name="ltx2-connectors",
    classes=("LTX2TextConnectors",),
    aliases=(),
    renames=(("aggregate_embed", "text_proj_in"),),
)

# The two towers of LTX2VideoTransformer3DModel and the text connectors (`connectors`), by diffusers' and
# the original (ComfyUI's) names: the audio<->video cross-attention and its modulation are cross-modal,
# `audio_*` is the audio tower, the rest (the video tower, its time and caption embeddings) video; the
# connectors' shared `text_proj_in` feeds both.
LTX2_MODALITIES = Modalities(
    rules=(
        ("cross", r"\.(audio_to_video_attn|video_to_audio_attn)\.|\.av_cross_attn_|_[av]2[av]_cross_attn_"),
        ("cross", r"\.av_ca_|_a2v_ca_"),
        ("cross", r"^\.text_proj_in$"),
        ("audio", r"\.audio_"),
    ),
    default="video",
)

# LTX-2.3 adds attention gates and prompt modulation to LTX-2; both add an audio tower to MMDiT-like blocks.
LTX23_ARCH = Architecture(
    "ltx2.3",
    label="LTX-2.3",
    signature=r"_to_gate_logits$|^(audio_)?prompt_adaln(_single)?_",
    skeleton=Skeleton(
        "transformer",
        "LTX2VideoTransformer3DModel",
        dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True),
        {},
        "LTX2VideoTransformer3DModel defaults plus LTX-2.3's attention gates and cross-attention modulation",
    ),
    cli_names=("ltx-2.3",),
    modalities=LTX2_MODALITIES,
)
# ComfyUI's LTXAVModel keyword defaults (LTX-2), for what its detection does not write.
_LTXAV = {
    "in_channels": 128,
    "audio_in_channels": 128,
    "cross_attention_dim": 4096,
    "audio_cross_attention_dim": 2048,
    "attention_head_dim": 128,
    "audio_attention_head_dim": 64,
    "num_attention_heads": 32,
    "audio_num_attention_heads": 32,
    "caption_channels": 3840,
    "num_layers": 48,
}


def _ltx2_from_comfy(cfg: dict) -> dict:
    out = {k: cfg.get(k, default) for k, default in _LTXAV.items()}
    out["out_channels"], out["audio_out_channels"] = out["in_channels"], out["audio_in_channels"]
    return out


def _ltx_video_from_comfy(cfg: dict) -> dict:
    # ComfyUI's detection reads the depth, the head width (at 32 heads) and the cross-attention width; the
    # latent and caption widths are LTXVModel's keyword arguments.
    in_channels = cfg.get("in_channels", 128)
    return {
        "in_channels": in_channels,
        "out_channels": in_channels,
        "num_attention_heads": cfg.get("num_attention_heads", 32),
        "attention_head_dim": cfg["attention_head_dim"],
        "cross_attention_dim": cfg["cross_attention_dim"],
        "num_layers": cfg["num_layers"],
        "caption_channels": cfg.get("caption_channels", 4096),
    }


LTX2_ARCH = Architecture(
    "ltx2",
    (LTX2, LTX2_CONNECTORS),
    label="LTX-2",
    signature=r"^transformer_blocks_\d+_(audio_(attn[12]|ff)|audio_to_video_attn|video_to_audio_attn)_"
    r"|^audio_adaln_single_|^av_ca_|^av_cross_attn_|^(audio_)?patchify_proj$|^audio_caption_projection_",
    owners=("ltx2.3",),
    skeleton=Skeleton(
        "transformer",
        "LTX2VideoTransformer3DModel",
        {},
        {},
        "LTX2VideoTransformer3DModel defaults (LTX-2: 48 blocks, hidden 4096, audio tower)",
    ),
    cli_names=("ltx-2",),
    layouts=Layouts(
        "ltx2 / ltx2.3",
        "Lightricks names (audio tower, audio-video cross-attention, adaln_single, prompt modulation, gate "
        "logits); text connectors (text_embedding_projection.)",
        "_convert_non_diffusers_ltx2_lora_to_diffusers",
        "test_arch_ltx_layouts.py::test_ltx2_*",
    ),
    comfy=ComfyFacets(("LTXAV",), _ltx2_from_comfy, skeleton="ltx2"),
    modalities=LTX2_MODALITIES,
)
# LTX-Video's original (Lightricks, ComfyUI) names differ from diffusers' by the renames of diffusers'
# `convert_ltx_transformer_checkpoint_to_diffusers` (LTX-2's first four); its LoRA files use the diffusers
# names.
LTX_VIDEO_TABLE = ArchTable(
    name="ltx-video",
    classes=("LTXVideoTransformer3DModel",),
    aliases=(),
    renames=(("patchify_proj", "proj_in"), ("q_norm", "norm_q"), ("k_norm", "norm_k")),
    prefix_renames=(("adaln_single.", "time_embed."),),
)
# LTX-Video: diffusers names (the cross-attention DiT family's), named by width.
LTX_VIDEO = Architecture(
    "ltx-video",
    (LTX_VIDEO_TABLE,),
    label="LTX-Video",
    skeleton=Skeleton(
        "transformer",
        "LTXVideoTransformer3DModel",
        {},
        {},
        "LTXVideoTransformer3DModel defaults (LTX-Video 0.9 2B: 28 blocks, hidden 2048)",
    ),
    cli_names=("ltxv", "ltx-video-2b"),
    layouts=Layouts(
        "hidream, ltx-video",
        "diffusers names behind diffusion_model. (prefix only); LTX-Video's Lightricks/ComfyUI names "
        "(patchify_proj, adaln_single, q_norm/k_norm)",
        "_convert_non_diffusers_hidream/ltxv_lora_to_diffusers, "
        "convert_ltx_transformer_checkpoint_to_diffusers",
        "test_arch_ltx_layouts.py::test_prefix_only_layouts_full_size, test_comfy_arch_names.py",
    ),
    comfy=ComfyFacets(("LTXV",), _ltx_video_from_comfy, skeleton="ltx-video"),
)
