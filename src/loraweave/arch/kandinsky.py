"""Kandinsky 5 and 6: diffusers names only (the diffusers port keeps the original module names)."""

from __future__ import annotations

from .record import Architecture, ComfyFacets, Skeleton

# Kandinsky 6 (audio tower, `attn.`, FeedForward `net`) shares Kandinsky 5's block names otherwise.
KANDINSKY6 = Architecture(
    "kandinsky6",
    label="Kandinsky 6",
    signature=r"^(audio_)?(visual|text)_transformer_blocks_\d+_(attn_|feed_forward_net_)|^audio_text_transformer_blocks_",
)


def _kandinsky5_from_comfy(cfg: dict) -> dict:
    # ComfyUI's Kandinsky5 keyword defaults for what its detection does not write. Its visual embedding reads
    # `visual_embed_dim` inputs; diffusers reads in_visual_dim (x2 + 1 mask channel with visual_cond) per
    # patch.
    patch = tuple(cfg.get("patch_size", (1, 2, 2)))
    in_visual = cfg.get("in_visual_dim", 16)
    per_patch = cfg.get("visual_embed_dim", 132) // (patch[0] * patch[1] * patch[2])
    return {
        "in_visual_dim": in_visual if per_patch == in_visual else (per_patch - 1) // 2,
        "visual_cond": per_patch != in_visual,
        "out_visual_dim": cfg.get("out_visual_dim", 16),
        "in_text_dim": cfg.get("in_text_dim", 3584),
        "in_text_dim2": cfg.get("in_text_dim2", 768),
        "time_dim": cfg.get("time_dim", 512),
        "patch_size": patch,
        "model_dim": cfg.get("model_dim", 1792),
        "ff_dim": cfg.get("ff_dim", 7168),
        "num_text_blocks": cfg.get("num_text_blocks", 2),
        "num_visual_blocks": cfg.get("num_visual_blocks", 32),
        "axes_dims": tuple(cfg.get("axes_dims", (16, 24, 24))),
    }


KANDINSKY5 = Architecture(
    "kandinsky5",
    label="Kandinsky 5",
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
    comfy=ComfyFacets(("Kandinsky5", "Kandinsky5Image"), _kandinsky5_from_comfy, skeleton="kandinsky5"),
)
