"""Lumina-Image 2.0: original (Alpha-VLLM, ComfyUI) names -> diffusers Lumina2Transformer2DModel modules.

Sources: diffusers `convert_lumina2_to_diffusers` and `_convert_non_diffusers_lumina2_lora_to_diffusers`. The
fused
`attention.qkv` is q | k | v with GQA widths (diffusers hard-codes [2304, 768, 768]; here the live modules
give them). The context refiner has no modulation, so its `attention_norm1` is a plain norm (`norm1`),
elsewhere the norm inside the zero-init modulation (`norm1.norm`).
"""

from __future__ import annotations

from .record import Architecture, ComfyFacets, Layouts, Skeleton
from .spec import Alias, ArchTable

_STACKS = ("layers.{i}", "noise_refiner.{i}", "context_refiner.{i}")


def _block(b: str) -> tuple[Alias, ...]:
    modulated = not b.startswith("context_refiner")
    return (
        Alias(f"{b}.attention.qkv", (f"{b}.attn.to_q", f"{b}.attn.to_k", f"{b}.attn.to_v")),
        Alias(f"{b}.attention.out", (f"{b}.attn.to_out.0",)),
        Alias(f"{b}.attention.q_norm", (f"{b}.attn.norm_q",)),
        Alias(f"{b}.attention.k_norm", (f"{b}.attn.norm_k",)),
        *(Alias(f"{b}.feed_forward.w{n}", (f"{b}.feed_forward.linear_{n}",)) for n in (1, 2, 3)),
        Alias(f"{b}.attention_norm1", (f"{b}.norm1.norm" if modulated else f"{b}.norm1",)),
        Alias(f"{b}.attention_norm2", (f"{b}.norm2",)),
        *((Alias(f"{b}.adaLN_modulation.1", (f"{b}.norm1.linear",)),) if modulated else ()),
    )


LUMINA2 = ArchTable(
    name="lumina2",
    classes=("Lumina2Transformer2DModel",),
    aliases=(
        *(a for b in _STACKS for a in _block(b)),
        Alias("cap_embedder.0", ("time_caption_embed.caption_embedder.0",)),
        Alias("cap_embedder.1", ("time_caption_embed.caption_embedder.1",)),
        Alias("t_embedder.mlp.0", ("time_caption_embed.timestep_embedder.linear_1",)),
        Alias("t_embedder.mlp.2", ("time_caption_embed.timestep_embedder.linear_2",)),
        # Scale only (no shift): nothing to swap.
        Alias("final_layer.adaLN_modulation.1", ("norm_out.linear_1",)),
        Alias("final_layer.linear", ("norm_out.linear_2",)),
    ),
)


def _lumina2_from_comfy(cfg: dict) -> dict:
    # ComfyUI's NextDiT feed-forward is ffn_dim_multiplier x dim wide; diffusers' is ffn_dim_multiplier x 4 x
    # dim.
    return {
        "patch_size": cfg.get("patch_size", 2),
        "in_channels": cfg.get("in_channels", 16),
        "hidden_size": cfg["dim"],
        "num_layers": cfg["n_layers"],
        "num_refiner_layers": cfg.get("n_refiner_layers", 2),
        "num_attention_heads": cfg.get("n_heads", 24),
        "num_kv_heads": cfg.get("n_kv_heads", 8),
        "multiple_of": cfg.get("multiple_of", 256),
        "ffn_dim_multiplier": cfg.get("ffn_dim_multiplier", 4.0) / 4,
        "axes_dim_rope": tuple(cfg.get("axes_dims", (32, 32, 32))),
        "axes_lens": tuple(cfg.get("axes_lens", (300, 512, 512))),
        "cap_feat_dim": cfg["cap_feat_dim"],
    }


LUMINA2_ARCH = Architecture(
    "lumina2",
    (LUMINA2,),
    label="Lumina 2",
    signature=r"^(layers|noise_refiner|context_refiner)_\d+_(attn_(to_[qkv]|to_out_0)|feed_forward_linear_[123]|norm1_linear)$",
    skeleton=Skeleton(
        "transformer",
        "Lumina2Transformer2DModel",
        {},
        {},
        "Lumina2Transformer2DModel defaults (Lumina-Image-2.0: 26 layers, hidden 2304)",
    ),
    cli_names=("lumina",),
    layouts=Layouts(
        "lumina2",
        "Alpha-VLLM/ComfyUI names (fused GQA qkv)",
        "convert_lumina2_to_diffusers, _convert_non_diffusers_lumina2_lora_to_diffusers",
        "test_arch_oracle.py, test_arch_ltx_layouts.py::test_lumina2_*",
    ),
    comfy=ComfyFacets(("Lumina2",), _lumina2_from_comfy, skeleton="lumina2"),
)
