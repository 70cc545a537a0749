"""Flux3: original (BFL/ComfyUI) names -> diffusers Flux3Transformer2DModel modules, by the converter's
renames.

Source: diffusers `_convert_non_diffusers_flux3_lora_to_diffusers` (renames only: `content_mode_blocks.` ->
`mode_blocks.`, `single_blocks.` -> `single_transformer_blocks.`, `q/k/v_proj` -> `attn.to_q/k/v`, `attn_out`
-> `attn.to_out.0`, `mlp_in/out` -> `ff.linear_in/out`); every other module keeps its diffusers name.
"""

from __future__ import annotations

from .record import Architecture, Layouts
from .spec import ArchTable

FLUX3 = ArchTable(
    name="flux3",
    classes=("Flux3Transformer2DModel",),
    aliases=(),
    renames=(
        ("content_mode_blocks.", "mode_blocks."),
        ("single_blocks.", "single_transformer_blocks."),
        (".q_proj.", ".attn.to_q."),
        (".k_proj.", ".attn.to_k."),
        (".v_proj.", ".attn.to_v."),
        (".attn_out.", ".attn.to_out.0."),
        (".mlp_in.", ".ff.linear_in."),
        (".mlp_out.", ".ff.linear_out."),
    ),
)

FLUX3_ARCH = Architecture(
    "flux3",
    (FLUX3,),
    label="Flux.3",
    layouts=Layouts(
        "flux3",
        "BFL names (content_mode_blocks, q/k/v_proj, attn_out, mlp_in/out), kohya-flattened",
        "_convert_non_diffusers_flux3_lora_to_diffusers",
        "test_arch_ltx_layouts.py::test_flux3_*",
    ),
)
