"""Ideogram4: original names -> diffusers Ideogram4Transformer2DModel modules.

Source: diffusers `_convert_non_diffusers_ideogram4_lora_to_diffusers`. The fused `attention.qkv` is q | k | v in
equal thirds (the converter's `chunk(3)`); `attention.o` is `attention.to_out.0` (the block's attention lives under
`attention.`, not `attn.`). `feed_forward.w1/w2/w3` and `adaln_modulation` keep their names. The converter strips a
`conditional_transformer.` prefix as well as `diffusion_model.`; kohya `lora_down/lora_up` + `.alpha` over these
dotted names is generic. The converter maps only `layers.N.*`; other modules keep their diffusers names.
"""

from __future__ import annotations

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
