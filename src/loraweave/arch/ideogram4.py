"""Ideogram4: original names -> diffusers Ideogram4Transformer2DModel modules.

Source: diffusers `_convert_non_diffusers_ideogram4_lora_to_diffusers`. The fused `attention.qkv` is q | k | v
in equal thirds (the converter's `chunk(3)`); `attention.o` is `attention.to_out.0` (the block's attention
lives under `attention.`, not `attn.`). `feed_forward.w1/w2/w3` and `adaln_modulation` keep their names. The
converter strips a `conditional_transformer.` prefix as well as `diffusion_model.`; kohya `lora_down/lora_up`
+ `.alpha` over these dotted names is generic. The converter maps only `layers.N.*`; other modules keep their
diffusers names.
"""

from __future__ import annotations

from .record import Architecture, Layouts, Skeleton
from .spec import Alias, ArchTable

_B = "layers.{i}.attention"

IDEOGRAM4 = ArchTable(
    name="ideogram4",
    classes=("Ideogram4Transformer2DModel",),
    aliases=(
        Alias(f"{_B}.qkv", (f"{_B}.to_q", f"{_B}.to_k", f"{_B}.to_v")),
        Alias(f"{_B}.o", (f"{_B}.to_out.0",)),
    ),
    prefix_renames=(("conditional_transformer.", ""),),
)

# Its own original names; its fused `attention.qkv` and `feed_forward.w1-3` are Z-Image's (shared, by width).
IDEOGRAM4_ARCH = Architecture(
    "ideogram4",
    (IDEOGRAM4,),
    label="Ideogram 4",
    signature=r"^layers_\d+_(attention_o|adaln_modulation)$",
    skeleton=Skeleton(
        "transformer",
        "Ideogram4Transformer2DModel",
        {},
        {},
        "Ideogram4Transformer2DModel defaults (34 layers, 18 heads x 256)",
    ),
    layouts=Layouts(
        "ideogram4",
        "original names (attention.qkv/o) behind diffusion_model./conditional_transformer./none, kohya "
        "lora_down/up + alpha",
        "_convert_non_diffusers_ideogram4_lora_to_diffusers",
        "test_arch_minimax_ideogram_qwen21.py::test_ideogram4_*",
    ),
)
