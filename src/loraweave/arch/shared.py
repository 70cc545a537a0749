"""Name families several architectures share (diffusers' MMDiT and cross-attention DiT block names): detection
records only; the architectures that own the names are listed most specific first."""

from __future__ import annotations

from .record import Architecture, Widths

# diffusers self-attention `attn1` next to cross-attention `attn2`: the cross-attention DiTs (LTX-Video,
# LTX-2's video tower, PixArt, Sana); SD3.5's dual attention pairs `attn2` with the joint `attn`, never
# `attn1`. Their attn2 / ff.net names go where the attn1 names go (mmdit's owners), not to SD3.5.
# Unclaimed, by attn1.to_q's input width (class defaults): LTX-2 (32 heads x 128; a video-only file has no
# audio names; LTX-Video 13B has the same names and sizes, and lands the same), LTX-Video 0.9 2B (32 x 64),
# PixArt-alpha/Sigma (16 x 72; Sana 600M shares the width, its own ff_conv names claim it first), Sana 1600M.
# Another width stays "cross-dit": a family, no release named. The releases named read their text at the
# hidden width (cross_attention_dim = hidden in all four): a file whose attn2 keys take another width
# (diffusers-named Cosmos-Predict2: 1024-wide text at 2048) is none of them and stays "cross-dit".
CROSS_DIT = Architecture(
    "cross-dit",
    signature=r"^transformer_blocks_\d+_attn1_",
    owners=("ltx2.3", "ltx2", "sana"),
    widths=Widths(
        r"^transformer_blocks_\d+_attn1_to_q$",
        {4096: "ltx2", 2048: "ltx-video", 1152: "pixart", 2240: "sana"},
        same_width=r"^transformer_blocks_\d+_attn2_to_k$",
    ),
)
# diffusers double-stream (MMDiT) names are shared by SD3 and Flux. Unclaimed, after the fold: SD3.5's dual
# attention (attn2 in a joint block), else the hidden width (input columns of attn.to_q): SD3 medium / SD3.5
# large / Flux.1 / HunyuanVideo 1.5 (16 heads x 128, double-stream blocks only) / HunyuanImage 2.1 (28 heads x
# 128), class defaults.
MMDIT = Architecture(
    "mmdit",
    signature=r"^transformer_blocks_\d+_(attn_(add_[qkv]_proj|to_add_out|to_[qkv]|to_out)|attn2_|ff_context|ff_net|norm1)",
    owners=("ltx2.3", "ltx2", "qwen-image-2.1", "qwen-image", "cross-dit"),
    widths=Widths(
        r"^transformer_blocks_\d+_attn_to_q$",
        {1536: "sd3", 2432: "sd3", 3072: "flux", 2048: "hunyuan-video-1.5", 3584: "hunyuan-image-2.1"},
    ),
)
