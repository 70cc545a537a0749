"""Kandinsky 5 and 6: diffusers names only (the diffusers port keeps the original module names)."""

from __future__ import annotations

from .record import Architecture, Skeleton

# Kandinsky 6 (audio tower, `attn.`, FeedForward `net`) shares Kandinsky 5's block names otherwise.
KANDINSKY6 = Architecture(
    "kandinsky6",
    signature=r"^(audio_)?(visual|text)_transformer_blocks_\d+_(attn_|feed_forward_net_)|^audio_text_transformer_blocks_",
)
KANDINSKY5 = Architecture(
    "kandinsky5",
    signature=r"^(visual|text)_transformer_blocks_\d+_",
    owners=("kandinsky6",),
    skeleton=Skeleton(
        "transformer",
        "Kandinsky5Transformer3DModel",
        {},
        {},
        "Kandinsky5Transformer3DModel defaults (32 visual / 2 text blocks, dim 2048)",
    ),
    cli_names=("kandinsky-5",),
    not_mapped=(
        "Kandinsky 5",
        "no converter: the diffusers port keeps the original module names (text_modulation, self_attention, "
        "visual_embeddings, ...) and KandinskyLoraLoaderMixin converts nothing; diffusers/PEFT and "
        "kohya-flattened names resolve 100 % on the full-size (Lite) model "
        "(test_arch_wan_animate_variants.py)",
    ),
)
