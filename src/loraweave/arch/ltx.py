"""LTX-Video and LTX-2 / 2.3: original (Lightricks, ComfyUI) names -> diffusers modules, by the converters' renames.

Sources: diffusers `_convert_non_diffusers_ltx2_lora_to_diffusers` and `convert_ltx2_transformer_to_diffusers`
(LTX-2: audio tower, audio<->video cross-attention and its modulation, `adaln_single` -> `time_embed`, `q_norm` ->
`norm_q`, prompt modulation of 2.3), `_convert_non_diffusers_ltxv_lora_to_diffusers` (LTX-Video: the names are
already the diffusers ones, only the `diffusion_model.` prefix differs, which the key parser strips). The text
connectors are a pipeline component of their own (`connectors`); their original prefix is
`text_embedding_projection.` and `aggregate_embed` is diffusers' `text_proj_in`.
"""

from __future__ import annotations

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
