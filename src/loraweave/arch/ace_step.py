"""ACE-Step 1.5 (music): original (ACE-Step-1.5 repo, ComfyUI, LyCORIS) names -> diffusers
AceStepTransformer1DModel modules.

Sources: diffusers `_convert_non_diffusers_ace_step_lora_to_diffusers` (the attention projections
`q_proj/k_proj/v_proj/o_proj` are `to_q/to_k/to_v/to_out.0`; PEFT files under `base_model.model.`) and
ComfyUI's key map (`comfy/lora.py`, ACEStep15: the DiT is `diffusion_model.decoder.`, LoRAs are
`base_model.model.<decoder path>` or LyCORIS `lycoris_<decoder path with _>`, LoKr + DoRA, ComfyUI PR
#12665). The MLP, the timestep embedders and `condition_embedder` keep their names; ComfyUI's patch
embedding `proj_in.1` (a Conv1d behind an Identity) is diffusers' `proj_in_conv`. The output
`proj_out.1` is a ConvTranspose1d (weight stored (in, out, k)): no alias, its keys stay unmapped.
"""

from __future__ import annotations

from .record import Architecture, Layouts, Skeleton
from .spec import Alias, ArchTable

_ATTN = {"q_proj": "to_q", "k_proj": "to_k", "v_proj": "to_v", "o_proj": "to_out.0"}

ACE_STEP = ArchTable(
    name="ace-step",
    classes=("AceStepTransformer1DModel",),
    aliases=(
        *(
            Alias(f"layers.{{i}}.{attn}.{src}", (f"layers.{{i}}.{attn}.{dst}",))
            for attn in ("self_attn", "cross_attn")
            for src, dst in _ATTN.items()
        ),
        Alias("proj_in.1", ("proj_in_conv",)),
    ),
    prefix_renames=(("decoder.", ""),),  # ComfyUI's own path of the DiT inside its model
)

ACE_STEP_ARCH = Architecture(
    "ace-step",
    (ACE_STEP,),
    label="ACE-Step 1.5",
    # Cross-attention in `layers.N` is ACE-Step's alone (LLM text encoders have self_attn only; Cosmos/Anima
    # and Wan name their stacks `blocks`).
    signature=r"^(decoder_)?layers_\d+_cross_attn_(to_([qkv]|out_0)|[qkvo]_proj)$",
    skeleton=Skeleton(
        "transformer",
        "AceStepTransformer1DModel",
        {},
        {},
        "AceStepTransformer1DModel defaults (ACE-Step 1.5: 24 layers, hidden 2048, GQA 16/8 heads)",
    ),
    cli_names=("ace-step-1.5", "acestep"),
    layouts=Layouts(
        "ace-step",
        "ACE-Step 1.5 names (q_proj/k_proj/v_proj/o_proj, base_model.model.), ComfyUI "
        "(diffusion_model.decoder.), LyCORIS (lycoris_layers_N_cross_attn_k_proj; LoKr, DoRA); proj_out.1 "
        "(ConvTranspose1d) not mapped",
        "_convert_non_diffusers_ace_step_lora_to_diffusers",
        "test_arch_ace_step.py",
    ),
)
