"""Krea2 transformer: original (krea-ai/krea-2, ComfyUI, AI-Toolkit) names -> diffusers
Krea2Transformer2DModel modules.

Source: diffusers `convert_krea2_transformer_checkpoint_to_diffusers` (and the LoRA converter's
`standalone_map`). Every projection is a separate module on both sides (q/k/v are GQA-sized); the per-block
modulation `mod.lin` and the final `last.modulation.lin` are bare parameters (`scale_shift_table`), not
modules: full-difference keys reach them through parameter aliases (the block table is stored flat, (6h,), and
reshaped to (6, h) as the converter does).
SimpleTuner/LyCORIS train a fused `attn.to_qkv` on the diffusers model: rows q | k | v with unequal (GQA)
widths, which whole-module targets express directly.
"""

from __future__ import annotations

from .record import Architecture, Layouts, Skeleton
from .spec import Alias, ArchTable, ParamAlias

_ATTN = {
    "wq": "to_q",
    "wk": "to_k",
    "wv": "to_v",
    "wo": "to_out.0",
    "gate": "to_gate",
    "qknorm.qnorm": "norm_q",
    "qknorm.knorm": "norm_k",
}
_BLOCK = {
    "mlp.gate": "ff.gate",
    "mlp.up": "ff.up",
    "mlp.down": "ff.down",
    "prenorm": "norm1",
    "postnorm": "norm2",
}


def _block(src: str, dst: str) -> tuple[Alias, ...]:
    return (
        *(Alias(f"{src}.attn.{a}", (f"{dst}.attn.{b}",)) for a, b in _ATTN.items()),
        *(Alias(f"{src}.{a}", (f"{dst}.{b}",)) for a, b in _BLOCK.items()),
        Alias(f"{dst}.attn.to_qkv", (f"{dst}.attn.to_q", f"{dst}.attn.to_k", f"{dst}.attn.to_v")),
    )


KREA2 = ArchTable(
    name="krea2",
    classes=("Krea2Transformer2DModel",),
    aliases=(
        *_block("blocks.{i}", "transformer_blocks.{i}"),
        *_block("txtfusion.layerwise_blocks.{i}", "text_fusion.layerwise_blocks.{i}"),
        *_block("txtfusion.refiner_blocks.{i}", "text_fusion.refiner_blocks.{i}"),
        Alias("txtfusion.projector", ("text_fusion.projector",)),
        Alias("first", ("img_in",)),
        Alias("tmlp.0", ("time_embed.linear_1",)),
        Alias("tmlp.2", ("time_embed.linear_2",)),
        Alias("tproj.1", ("time_mod_proj",)),
        Alias("txtmlp.0", ("txt_in.norm",)),
        Alias("txtmlp.1", ("txt_in.linear_1",)),
        Alias("txtmlp.3", ("txt_in.linear_2",)),
        Alias("last.linear", ("final_layer.linear",)),
        Alias("last.norm", ("final_layer.norm",)),
    ),
    parameters=(
        ParamAlias("blocks.{i}.mod.lin", "transformer_blocks.{i}.scale_shift_table", reshape=True),
        ParamAlias("last.modulation.lin", "final_layer.scale_shift_table"),
    ),
)


def _inverted(table: ArchTable) -> tuple[Alias, ...]:
    """The table's one-to-one and fused aliases the other way: diffusers names onto the original modules."""
    whole = [
        (a.source, t) for a in table.aliases if len(a.targets) == 1 and isinstance(t := a.targets[0], str)
    ]
    out = [Alias(target, (source,)) for source, target in whole]
    out += [
        Alias(
            a.source,
            tuple(n for t in a.targets for b in table.aliases if b.targets == (t,) for n in [b.source]),
        )
        for a in table.aliases
        if len(a.targets) > 1
    ]
    # comfy.utils.krea2_to_diffusers also reads `attn.to_out` without its `.0`.
    out += [Alias(f"{d}.attn.to_out", (f"{s}.attn.wo",)) for s, d in _CHAINS]
    return tuple(out)


_CHAINS = (
    ("blocks.{i}", "transformer_blocks.{i}"),
    ("txtfusion.layerwise_blocks.{i}", "text_fusion.layerwise_blocks.{i}"),
    ("txtfusion.refiner_blocks.{i}", "text_fusion.refiner_blocks.{i}"),
)
# ComfyUI's Krea 2 (comfy.ldm.krea2.SingleStreamDiT) keeps the original names; the diffusers names its key map
# lands (comfy.utils.krea2_to_diffusers: `transformer.`, `lycoris_`, bare, `diffusion_model.`) resolve on it
# through the table inverted.
KREA2_COMFY = ArchTable(name="krea2-comfyui", classes=("SingleStreamDiT",), aliases=_inverted(KREA2))

KREA2_ARCH = Architecture(
    "krea2",
    (KREA2, KREA2_COMFY),
    label="Krea 2",
    skeleton=Skeleton("transformer", "Krea2Transformer2DModel", {}, {}, "Krea2Transformer2DModel defaults"),
    cli_names=("krea-2", "krea"),
    layouts=Layouts(
        "krea2",
        "krea-ai names, SimpleTuner fused to_qkv, mod.lin modulation tables",
        "convert_krea2_transformer_checkpoint_to_diffusers",
        "test_arch_dits2.py, test_param_patches.py",
    ),
)
