"""Wan 2.1 / 2.2: original (Wan, musubi, ComfyUI) names -> diffusers WanTransformer3DModel modules."""

from __future__ import annotations

from .record import Architecture, BlockMap, ComfyFacets, Layouts, Release, Skeleton
from .spec import Alias, ArchTable, ParamAlias, VariantOnly

_B = "blocks.{i}"


def _attn(block: str, src: str, dst: str) -> tuple[Alias, ...]:
    names = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "norm_q": "norm_q", "norm_k": "norm_k"}
    return tuple(Alias(f"{block}.{src}.{a}", (f"{block}.{dst}.{b}",)) for a, b in names.items())


def _block(b: str) -> tuple[Alias, ...]:
    return (
        *_attn(b, "self_attn", "attn1"),
        *_attn(b, "cross_attn", "attn2"),
        Alias(f"{b}.ffn.0", (f"{b}.ffn.net.0.proj",)),
        Alias(f"{b}.ffn.2", (f"{b}.ffn.net.2",)),
        # Wan's norm3 (before cross-attention, affine) is diffusers' norm2; Wan's norm2 has no weights.
        Alias(f"{b}.norm3", (f"{b}.norm2",)),
    )


_V = "vace_blocks.{i}"

WAN = ArchTable(
    name="wan",
    classes=("WanTransformer3DModel", "WanVACETransformer3DModel"),
    aliases=(
        *_block(_B),
        # I2V only: on a T2V model these targets do not exist and the keys are reported as such.
        Alias(f"{_B}.cross_attn.k_img", (f"{_B}.attn2.add_k_proj",)),
        Alias(f"{_B}.cross_attn.v_img", (f"{_B}.attn2.add_v_proj",)),
        Alias(f"{_B}.cross_attn.norm_k_img", (f"{_B}.attn2.norm_added_k",)),
        # VACE: control blocks with the same layout plus their in/out projections (the converter's renames).
        *_block(_V),
        Alias(f"{_V}.before_proj", (f"{_V}.proj_in",)),
        Alias(f"{_V}.after_proj", (f"{_V}.proj_out",)),
        Alias("time_embedding.0", ("condition_embedder.time_embedder.linear_1",)),
        Alias("time_embedding.2", ("condition_embedder.time_embedder.linear_2",)),
        Alias("text_embedding.0", ("condition_embedder.text_embedder.linear_1",)),
        Alias("text_embedding.2", ("condition_embedder.text_embedder.linear_2",)),
        Alias("time_projection.1", ("condition_embedder.time_proj",)),
        Alias("img_emb.proj.0", ("condition_embedder.image_embedder.norm1",)),
        Alias("img_emb.proj.1", ("condition_embedder.image_embedder.ff.net.0.proj",)),
        Alias("img_emb.proj.3", ("condition_embedder.image_embedder.ff.net.2",)),
        Alias("img_emb.proj.4", ("condition_embedder.image_embedder.norm2",)),
        Alias("head.head", ("proj_out",)),
    ),
    # convert_wan_transformer_to_diffusers: `modulation` -> `scale_shift_table`, same (1, 6|2, dim) layout.
    parameters=(
        ParamAlias(f"{_B}.modulation", f"{_B}.scale_shift_table"),
        ParamAlias("head.modulation", "scale_shift_table"),
        ParamAlias(f"{_V}.modulation", f"{_V}.scale_shift_table"),
    ),
    variant_only=(
        VariantOnly(
            tuple(
                f"{_B}.{n}"
                for n in (
                    "cross_attn.k_img",
                    "cross_attn.v_img",
                    "cross_attn.norm_k_img",
                    "attn2.add_k_proj",
                    "attn2.add_v_proj",
                    "attn2.norm_added_k",
                )
            ),
            f"{_B}.attn2.to_k",
            "image cross-attention exists only in Wan 2.1 I2V/FLF2V; this variant (T2V, or Wan 2.2) has none",
        ),
        VariantOnly(
            (
                *(f"img_emb.proj.{n}" for n in (0, 1, 3, 4)),
                *(
                    f"condition_embedder.image_embedder.{n}"
                    for n in ("norm1", "ff.net.0.proj", "ff.net.2", "norm2")
                ),
            ),
            "condition_embedder.time_embedder.linear_1",
            "the CLIP image embedder exists only in Wan 2.1 I2V/FLF2V; this variant (T2V, or Wan 2.2) has "
            "none",
        ),
    ),
)


def wan_from_comfy(cfg: dict) -> dict:
    return {
        "patch_size": tuple(cfg["patch_size"]),
        "num_attention_heads": cfg["num_heads"],
        "attention_head_dim": cfg["dim"] // cfg["num_heads"],
        "in_channels": cfg["in_dim"],
        "out_channels": cfg["out_dim"],
        "ffn_dim": cfg["ffn_dim"],
        "num_layers": cfg["num_layers"],
        "freq_dim": cfg["freq_dim"],
        "text_dim": cfg.get("text_dim", 4096),  # ComfyUI always builds a 4096-wide text embedding
    }


# Releases (in `releases=`): from the released configs (realdata/configs).
WAN_ARCH = Architecture(
    "wan",
    (WAN,),
    label="Wan",
    signature=r"^blocks_\d+_(self_attn|cross_attn|attn1|attn2|ffn)",
    owners=("wan-animate",),
    takes=("wan-animate",),  # Animate LoRAs: block keys are Wan's own, Animate-only keys expected absent
    skeleton=Skeleton(
        "transformer",
        "WanTransformer3DModel",
        dict(
            added_kv_proj_dim=None,
            attention_head_dim=128,
            cross_attn_norm=True,
            eps=1e-6,
            ffn_dim=13824,
            freq_dim=256,
            in_channels=16,
            num_attention_heads=40,
            num_layers=40,
            out_channels=16,
            patch_size=[1, 2, 2],
            qk_norm="rms_norm_across_heads",
            text_dim=4096,
        ),
        {},
        "Wan2.1 T2V 14B config",
    ),
    blocks=BlockMap("wan", (("B", "blocks", 30),)),
    layouts=Layouts(
        "wan 2.1 / 2.2 (+VACE)",
        "Wan/ComfyUI names, musubi-tuner (lora_unet_), diffusion-pipe (diffusion_model.), lightx2v "
        "diff/diff_b/diff_m, VACE blocks",
        "convert_wan_transformer_to_diffusers, _convert_musubi_wan_lora_to_diffusers, "
        "_convert_non_diffusers_wan_lora_to_diffusers",
        "test_arch_oracle.py, test_arch_ltx_layouts.py::test_*wan*, test_param_patches.py",
    ),
    releases=(
        Release("wan-14b (2.1 T2V/I2V/FLF2V/VACE, 2.2 A14B/Animate)", {"blocks": 40}, 5120),
        Release("wan-1.3b (2.1 T2V/VACE)", {"blocks": 30}, 1536),
        Release("wan2.2-ti2v-5b", {"blocks": 30}, 3072),
    ),
    comfy=ComfyFacets(
        ("WAN21_T2V", "WAN22_T2V", "WAN21_I2V"), wan_from_comfy, {"num_layers": ("blocks",)}, skeleton="wan"
    ),
)
