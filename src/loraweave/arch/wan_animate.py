"""Wan 2.2 Animate: original (Wan) names -> diffusers WanAnimateTransformer3DModel modules.

Source: diffusers `convert_wan_transformer_to_diffusers` (the single-file converter
WanAnimateTransformer3DModel uses). The 40 transformer blocks and the condition embedder are Wan's, with Wan's
names (the `wan` table). Animate adds the face adapter (`face_adapter.fuser_blocks.N`: `linear1_q`, fused
`linear1_kv` = k | v halves, `linear2`, `q_norm`/`k_norm`), the face encoder (convolutions wrapped as
`convN.conv`) and the motion encoder (StyleGAN-style `enc.net_app.convs.N`, `enc.fc.N`, `dec.direction`). The
converter writes the motion encoder for the released 512 px encoder: convs.0 is the input conv, convs.1..7 the
seven residual blocks, convs.8 the output conv.
"""

from __future__ import annotations

from .record import Architecture, ComfyFacets, Layouts, Skeleton
from .spec import Alias, ArchTable, ParamAlias, VariantOnly
from .wan import WAN, wan_from_comfy

_F, _LF = "face_adapter.fuser_blocks.{i}", "face_adapter.{i}"
_ENC, _ME = "motion_encoder.enc.net_app.convs", "motion_encoder"
RES_BLOCKS = 7  # the converter's count (log2(512) - 2 residual blocks)


def _motion_res_block(i: int) -> tuple[Alias, ...]:
    c, r = f"{_ENC}.{i + 1}", f"{_ME}.res_blocks.{i}"  # original convs are numbered from the input conv
    return (
        Alias(f"{c}.conv1.0", (f"{r}.conv1",)),
        Alias(f"{c}.conv2.1", (f"{r}.conv2",)),
        Alias(f"{c}.skip.1", (f"{r}.conv_skip",)),
    )


def _motion_biases(i: int) -> tuple[ParamAlias, ...]:
    # The activation's channel bias is stored (1, C, 1, 1) in the original, (C,) live: the converter reshapes
    # it.
    c, r = f"{_ENC}.{i + 1}", f"{_ME}.res_blocks.{i}"
    return (
        ParamAlias(f"{c}.conv1.1.bias", f"{r}.conv1.act_fn.bias", reshape=True),
        ParamAlias(f"{c}.conv2.2.bias", f"{r}.conv2.act_fn.bias", reshape=True),
    )


WAN_ANIMATE = ArchTable(
    name="wan-animate",
    classes=("WanAnimateTransformer3DModel",),
    aliases=(
        *WAN.aliases,  # blocks, condition embedder (VACE rows find no targets here)
        Alias(f"{_F}.linear1_q", (f"{_LF}.to_q",)),
        Alias(f"{_F}.linear1_kv", (f"{_LF}.to_k", f"{_LF}.to_v")),  # the converter splits the rows in halves
        Alias(f"{_F}.linear2", (f"{_LF}.to_out",)),
        Alias(f"{_F}.q_norm", (f"{_LF}.norm_q",)),
        Alias(f"{_F}.k_norm", (f"{_LF}.norm_k",)),
        *(Alias(f"face_encoder.{c}.conv", (f"face_encoder.{c}",)) for c in ("conv1_local", "conv2", "conv3")),
        Alias(f"{_ENC}.0.0", (f"{_ME}.conv_in",)),
        *(a for i in range(RES_BLOCKS) for a in _motion_res_block(i)),
        Alias(f"{_ENC}.{RES_BLOCKS + 1}", (f"{_ME}.conv_out",)),
        Alias(f"{_ME}.enc.fc.{{i}}", (f"{_ME}.motion_network.{{i}}",)),
    ),
    parameters=(
        *(p for p in WAN.parameters if not p.source.startswith("vace_")),
        ParamAlias(f"{_ENC}.0.1.bias", f"{_ME}.conv_in.act_fn.bias", reshape=True),
        *(p for i in range(RES_BLOCKS) for p in _motion_biases(i)),
        # `dec.direction` is a bare weight in the original; a full diff may name the module or the parameter.
        ParamAlias(f"{_ME}.dec.direction.weight", f"{_ME}.motion_synthesis_weight"),
        ParamAlias(f"{_ME}.dec.direction", f"{_ME}.motion_synthesis_weight"),
    ),
)


def _animate_only() -> tuple[str, ...]:
    """Every spelling (original and diffusers) of the modules and parameters only Wan Animate has."""
    extra = [a for a in WAN_ANIMATE.aliases if a not in WAN.aliases]
    names = {a.source for a in extra} | {
        t if isinstance(t, str) else t.module for a in extra for t in a.targets
    }
    names |= {p.source for p in WAN_ANIMATE.parameters if p not in WAN.parameters}
    return tuple(sorted(names | {"face_encoder.out_proj", "pose_patch_embedding"}))


# On the other Wan transformers, an Animate file's face adapter / encoder and motion encoder keys are expected
# absent (the blocks still land). Kept apart from WAN because these names come from the Animate table.
WAN_ANIMATE_ONLY = ArchTable(
    name="wan-animate-only",
    classes=WAN.classes,
    aliases=(),
    variant_only=(
        VariantOnly(
            _animate_only(),
            "blocks.{i}.attn1.to_q",
            "the face adapter, face encoder and motion encoder exist only in Wan 2.2 Animate",
        ),
    ),
)

# Wan-Animate-2: `convert_wan_animate_2_transformer_to_diffusers` drops the in-context wrapper level of the
# official checkpoint (`blocks.N.block.X` -> `blocks.N.X`) and renames q/k/v/o (+ image k/v) inside attention;
# every other name (ffn.0, norm3, modulation, head.head, img_emb, ...) is the original one.
# Longer names first: kohya-flattened `_cross_attn_k_img_` also contains `_cross_attn_k_`.
_ATTN2 = (
    ("k_img", "add_k_proj"),
    ("v_img", "add_v_proj"),
    ("norm_k_img", "norm_added_k"),
    ("q", "to_q"),
    ("k", "to_k"),
    ("v", "to_v"),
    ("o", "to_out.0"),
)

WAN_ANIMATE_2 = ArchTable(
    name="wan-animate-2",
    classes=("WanAnimate2Transformer3DModel",),
    aliases=(),
    renames=(
        (".block.", "."),
        *(
            (f".{attn}.{old}.", f".{attn}.{new}.")
            for attn in ("self_attn", "cross_attn")
            for old, new in _ATTN2
        ),
    ),
)


def _wan_animate_from_comfy(cfg: dict) -> dict:
    # ComfyUI's AnimateWanModel is Wan I2V (image cross-attention on 1280-wide CLIP features projected to dim)
    # plus a face adapter every 5 blocks; its pose input (16 channels), face encoder (1024 x 4 heads) and 512
    # px motion encoder are fixed, as in diffusers' defaults.
    return {**wan_from_comfy(cfg), "added_kv_proj_dim": cfg["dim"], "image_dim": 1280, "latent_channels": 16}


# Wan blocks plus the face adapter / face and motion encoders (original or diffusers names).
WAN_ANIMATE_ARCH = Architecture(
    "wan-animate",
    (WAN_ANIMATE, WAN_ANIMATE_ONLY),
    label="Wan Animate",
    signature=r"^face_adapter_(fuser_blocks_)?\d+_|^(motion|face)_encoder_",
    skeleton=Skeleton(
        "transformer",
        "WanAnimateTransformer3DModel",
        dict(
            added_kv_proj_dim=5120,
            image_dim=1280,
            in_channels=36,
            num_attention_heads=40,
            num_layers=40,
            ffn_dim=13824,
            text_dim=4096,
            inject_face_latents_blocks=5,
        ),
        {},
        "Wan2.2-Animate-14B config (diffusers conversion script)",
    ),
    layouts=Layouts(
        "wan 2.2 animate",
        "Wan names (blocks, condition embedder), face adapter (fuser_blocks, fused linear1_kv halves), face "
        "encoder (convN.conv), motion encoder (enc.net_app.convs, enc.fc, dec.direction, (1, C, 1, 1) "
        "biases); those keys are expected_absent on the other Wan transformers",
        "convert_wan_transformer_to_diffusers",
        "test_arch_wan_animate_variants.py",
    ),
    comfy=ComfyFacets(("WAN22_Animate",), _wan_animate_from_comfy, skeleton="wan-animate"),
)
# The official checkpoint wraps every block: `blocks.N.block.self_attn.q`.
WAN_ANIMATE_2_ARCH = Architecture(
    "wan-animate-2",
    (WAN_ANIMATE_2,),
    label="Wan Animate 2",
    signature=r"^blocks_\d+_block_(self_attn|cross_attn|ffn|norm3)",
    skeleton=Skeleton(
        "transformer",
        "WanAnimate2Transformer3DModel",
        {},
        {},
        "WanAnimate2Transformer3DModel defaults (14B: dim 5120, 40 blocks)",
    ),
    layouts=Layouts(
        "wan animate 2",
        "official names (blocks.N.block. wrapper, q/k/v/o, k_img/v_img), kohya-flattened",
        "convert_wan_animate_2_transformer_to_diffusers",
        "test_arch_wan_animate_variants.py::test_animate2_*",
    ),
)
