"""Flux.1 (and Chroma-like) transformer: BFL/ComfyUI original names -> diffusers modules."""

from __future__ import annotations

from .encoders import CLIP_L, T5_XXL
from .record import Architecture, BlockMap, ComfyFacets, Layouts, Release, Skeleton
from .spec import (
    Alias,
    ArchTable,
    ColumnSplit,
    InterleavedRows,
    ModelInput,
    Rows,
    VariantInput,
    VariantOnly,
)

_D = "transformer_blocks.{i}"
_S = "single_transformer_blocks.{i}"
NUNCHAKU_FLUX_CLASS = "NunchakuFluxTransformer2DModelV2"

FILL_INPUT = VariantInput(
    "x_embedder",
    384,
    "x_embedder takes 384 input channels only in Flux Fill (latents, masked-image latents, mask); this "
    "model's takes another width",
)

FLUX = ArchTable(
    name="flux",
    # Nunchaku's class keeps the names these aliases reach; its fused and refused ones are NUNCHAKU_FLUX's.
    classes=("FluxTransformer2DModel", NUNCHAKU_FLUX_CLASS),
    aliases=(
        Alias("double_blocks.{i}.img_attn.qkv", (f"{_D}.attn.to_q", f"{_D}.attn.to_k", f"{_D}.attn.to_v")),
        Alias(
            "double_blocks.{i}.txt_attn.qkv",
            (f"{_D}.attn.add_q_proj", f"{_D}.attn.add_k_proj", f"{_D}.attn.add_v_proj"),
        ),
        Alias("double_blocks.{i}.img_attn.proj", (f"{_D}.attn.to_out.0",)),
        Alias("double_blocks.{i}.txt_attn.proj", (f"{_D}.attn.to_add_out",)),
        Alias("double_blocks.{i}.img_mlp.0", (f"{_D}.ff.net.0.proj",)),
        Alias("double_blocks.{i}.img_mlp.2", (f"{_D}.ff.net.2",)),
        Alias("double_blocks.{i}.txt_mlp.0", (f"{_D}.ff_context.net.0.proj",)),
        Alias("double_blocks.{i}.txt_mlp.2", (f"{_D}.ff_context.net.2",)),
        # LyCORIS names the double-block MLP linear_in/linear_out.
        Alias("double_blocks.{i}.img_mlp.linear_in", (f"{_D}.ff.net.0.proj",)),
        Alias("double_blocks.{i}.img_mlp.linear_out", (f"{_D}.ff.net.2",)),
        # Modulation chunks (shift, scale, gate) x 2 are in the same order on both sides.
        Alias("double_blocks.{i}.img_mod.lin", (f"{_D}.norm1.linear",)),
        Alias("double_blocks.{i}.txt_mod.lin", (f"{_D}.norm1_context.linear",)),
        # linear1 rows are q | k | v | mlp; widths come from the live modules, not from constants.
        Alias(
            "single_blocks.{i}.linear1",
            (f"{_S}.attn.to_q", f"{_S}.attn.to_k", f"{_S}.attn.to_v", f"{_S}.proj_mlp"),
        ),
        Alias("single_blocks.{i}.linear1_qkv", (f"{_S}.attn.to_q", f"{_S}.attn.to_k", f"{_S}.attn.to_v")),
        Alias("single_blocks.{i}.linear2", (f"{_S}.proj_out",)),
        Alias("single_blocks.{i}.modulation.lin", (f"{_S}.norm.linear",)),
        # q/k RMSNorm weights (BFL control LoRAs replace them through `*.norm.query_norm.scale`).
        Alias("double_blocks.{i}.img_attn.norm.query_norm", (f"{_D}.attn.norm_q",)),
        Alias("double_blocks.{i}.img_attn.norm.key_norm", (f"{_D}.attn.norm_k",)),
        Alias("double_blocks.{i}.txt_attn.norm.query_norm", (f"{_D}.attn.norm_added_q",)),
        Alias("double_blocks.{i}.txt_attn.norm.key_norm", (f"{_D}.attn.norm_added_k",)),
        Alias("single_blocks.{i}.norm.query_norm", (f"{_S}.attn.norm_q",)),
        Alias("single_blocks.{i}.norm.key_norm", (f"{_S}.attn.norm_k",)),
        Alias("img_in", ("x_embedder",)),
        Alias("txt_in", ("context_embedder",)),
        Alias("time_in.in_layer", ("time_text_embed.timestep_embedder.linear_1",)),
        Alias("time_in.out_layer", ("time_text_embed.timestep_embedder.linear_2",)),
        Alias("vector_in.in_layer", ("time_text_embed.text_embedder.linear_1",)),
        Alias("vector_in.out_layer", ("time_text_embed.text_embedder.linear_2",)),
        Alias("guidance_in.in_layer", ("time_text_embed.guidance_embedder.linear_1",)),
        Alias("guidance_in.out_layer", ("time_text_embed.guidance_embedder.linear_2",)),
        # BFL stores (shift, scale); diffusers' AdaLayerNormContinuous stores (scale, shift): swap the halves.
        Alias(
            "final_layer.adaLN_modulation.1", (Rows("norm_out.linear", 1, 2), Rows("norm_out.linear", 0, 2))
        ),
        Alias("final_layer.linear", ("proj_out",)),
    ),
    # BFL Canny/Depth (128 = latents + control latent) are control adapters: a 64-column x_embedder grows.
    model_inputs=(ModelInput("x_embedder", "proj_out", "in_channels", control=2),),
    # Flux.1 Fill (in_channels 384: latents | masked-image latents | mask) vs 64 for dev/schnell/Kontext;
    # Kontext adds no module (its reference image is more tokens).
    variant_inputs=(FILL_INPUT,),
    variant_only=(
        VariantOnly(
            (
                "guidance_in.in_layer",
                "guidance_in.out_layer",
                "time_text_embed.guidance_embedder.linear_1",
                "time_text_embed.guidance_embedder.linear_2",
            ),
            "time_text_embed.timestep_embedder.linear_1",
            "the guidance embedder exists only in guidance-distilled Flux (dev, Fill, Kontext); this one "
            "(schnell) has none",
        ),
    ),
)


def _thirds(fused: str, parts: tuple[str, ...]) -> tuple[Alias, ...]:
    """Each of three equal projections onto its third of the live module fusing them (rows in that order)."""
    return tuple(Alias(p, (Rows(fused, n, 3),)) for n, p in enumerate(parts))


# Nunchaku's modulation (AWQ W4A16) stores the six (or three) chunks interleaved per hidden unit: its forward
# reads row d * 6 + c where diffusers reads c * dim + d. A delta lands with its rows gathered into that order.
def nunchaku_modulation(names: tuple[str, ...], chunks: int) -> InterleavedRows:
    return InterleavedRows(names, chunks, "AWQW4A16Linear")


# Nunchaku's Flux.1 (transformer_flux_v2): the diffusers tree with q/k/v fused into `attn.to_qkv` (rows
# q | k | v), the context q/k/v into `attn.add_qkv_proj`, the single block's `proj_mlp` renamed `mlp_fc1` and
# its `proj_out` split by input columns into `attn.to_out` (attention, 3072) and `mlp_fc2` (MLP, 12288).
NUNCHAKU_FLUX = ArchTable(
    name="flux-nunchaku",
    classes=(NUNCHAKU_FLUX_CLASS,),
    aliases=(
        Alias("double_blocks.{i}.img_attn.qkv", (f"{_D}.attn.to_qkv",)),
        Alias("double_blocks.{i}.txt_attn.qkv", (f"{_D}.attn.add_qkv_proj",)),
        Alias("single_blocks.{i}.linear1", (f"{_S}.attn.to_qkv", f"{_S}.mlp_fc1")),
        Alias("single_blocks.{i}.linear1_qkv", (f"{_S}.attn.to_qkv",)),
    ),
    runtime_fusions=(
        *_thirds(f"{_D}.attn.to_qkv", tuple(f"{_D}.attn.to_{p}" for p in "qkv")),
        *_thirds(f"{_D}.attn.add_qkv_proj", tuple(f"{_D}.attn.add_{p}_proj" for p in "qkv")),
        *_thirds(f"{_S}.attn.to_qkv", tuple(f"{_S}.attn.to_{p}" for p in "qkv")),
        Alias(f"{_S}.proj_mlp", (f"{_S}.mlp_fc1",)),
    ),
    # proj_out(cat(attention, MLP)) = to_out(attention) + mlp_fc2(MLP): Nunchaku's forward sums the two.
    column_splits=(
        ColumnSplit((f"{_S}.proj_out", "single_blocks.{i}.linear2"), (f"{_S}.attn.to_out", f"{_S}.mlp_fc2")),
    ),
    interleaved_rows=(
        nunchaku_modulation((f"{_D}.norm1.linear", f"{_D}.norm1_context.linear"), 6),
        nunchaku_modulation((f"{_S}.norm.linear",), 3),
    ),
)


# Chroma: Flux blocks without per-block modulation; an approximator replaces the time/vector embedders.
CHROMA = ArchTable(
    name="chroma",
    classes=("ChromaTransformer2DModel",),
    aliases=(
        *(a for a in FLUX.aliases if "_mod." not in a.source and "modulation" not in a.source),
        Alias(
            "distilled_guidance_layer.layers.{i}.in_layer", ("distilled_guidance_layer.layers.{i}.linear_1",)
        ),
        Alias(
            "distilled_guidance_layer.layers.{i}.out_layer", ("distilled_guidance_layer.layers.{i}.linear_2",)
        ),
    ),
    # No control input: ComfyUI's Chroma never concatenates a control latent (its concat_cond compares
    # img_in's channels per patch with out_channels counted after patching), nor has diffusers a pipeline.
    model_inputs=(ModelInput("x_embedder", "proj_out", "in_channels"),),
    variant_inputs=(FILL_INPUT,),  # a Flux Fill LoRA's x_embedder, as on Flux dev
)

_FLUX = dict(
    attention_head_dim=128,
    guidance_embeds=True,
    in_channels=64,
    joint_attention_dim=4096,
    num_attention_heads=24,
    num_layers=19,
    num_single_layers=38,
    patch_size=1,
    pooled_projection_dim=768,
)
_FLUX_CHAINS = (("D", "transformer_blocks", 19), ("S", "single_transformer_blocks", 38))

# BFL names, and diffusers' single-block names (its double-stream names are the MMDiT family's). Flux.1 (and
# Chroma) have 19 double / 38 single blocks; HunyuanVideo and Qwen-Image share the names deeper (their depth).
FLUX_BLOCKS = BlockMap("flux", _FLUX_CHAINS)  # Flux.1 dev and schnell


def double_single_from_comfy(cfg: dict, patched: bool = True) -> dict:
    """The entries every BFL-style double/single-block model shares (Flux.1, Flux.2, Chroma) from ComfyUI's
    unet_config; `patched`: ComfyUI counts channels before patching (Chroma counts them after, as diffusers
    does)."""
    patch = cfg.get("patch_size", 1) if patched else 1
    return {
        "in_channels": cfg["in_channels"] * patch * patch,
        "out_channels": cfg["out_channels"] * patch * patch,
        "num_layers": cfg["depth"],
        "num_single_layers": cfg["depth_single_blocks"],
        "attention_head_dim": cfg["hidden_size"] // cfg["num_heads"],
        "num_attention_heads": cfg["num_heads"],
        "joint_attention_dim": cfg["context_in_dim"],
        "axes_dims_rope": tuple(cfg["axes_dim"]),
    }


def _flux_from_comfy(cfg: dict) -> dict:
    out = {
        **double_single_from_comfy({"patch_size": 2, **cfg}),
        "pooled_projection_dim": cfg["vec_in_dim"],
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }
    if out["out_channels"] == out["in_channels"]:
        out["out_channels"] = (
            None  # diffusers' own spelling (None is in_channels), as the shipped skeleton stores it
        )
    return out


def _chroma_from_comfy(cfg: dict) -> dict:
    return {
        **double_single_from_comfy(cfg, patched=False),
        "approximator_num_channels": cfg.get("in_dim", 64),
        "approximator_hidden_dim": cfg.get("hidden_dim", 5120),
        "approximator_layers": cfg.get("n_layers", 5),
    }


_FLUX_DEPTHS: dict[str, tuple[str, ...]] = {
    "num_layers": ("transformer_blocks",),
    "num_single_layers": ("single_transformer_blocks",),
}
# Flux Fill / Kontext / control widen the patch input to 384 channels and set out_channels.
_FLUX_WIDTHS = {"in_channels": ("x_embedder", 1, None), "out_channels": ("proj_out", 0, "in_channels")}


# Releases (in `releases=`): from the released configs (realdata/configs).
FLUX_ARCH = Architecture(
    "flux",
    (FLUX, NUNCHAKU_FLUX),
    label="Flux",
    signature=r"^double_blocks_\d+_(img|txt)_|^single_blocks_\d+_linear[12]|^single_transformer_blocks_\d+_",
    owners=("hunyuan-video", "hunyuan-image-2.1"),  # diffusers single-block names; else by MMDiT width
    depth=("flux", {"double": 19, "single": 38}),
    skeleton=Skeleton(
        "transformer",
        "FluxTransformer2DModel",
        _FLUX,
        {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL},
        "flux1-dev transformer config",
    ),
    cli_names=("flux1", "flux-dev"),
    blocks=FLUX_BLOCKS,
    layouts=Layouts(
        "flux / flux-schnell / chroma",
        "BFL/ComfyUI names, kohya, XLabs processor LoRAs, fal Kontext (base_model.model.); a Fill-trained "
        "x_embedder (384 inputs) is expected_absent on other input widths (Kontext has no module of its own)",
        "convert_flux_transformer_checkpoint_to_diffusers, _convert_xlabs_flux_lora_to_diffusers, "
        "_convert_fal_kontext_lora_to_diffusers",
        "test_layouts.py, test_arch_ltx_layouts.py::test_xlabs_*, ::test_fal_kontext_*, "
        "test_arch_wan_animate_variants.py::test_fill_*",
    ),
    releases=(Release("flux1 (dev, schnell, Fill, Kontext)", {"double": 19, "single": 38}, 3072, 7),),
    comfy=ComfyFacets(("Flux",), _flux_from_comfy, _FLUX_DEPTHS, _FLUX_WIDTHS, skeleton="flux"),
)
FLUX_SCHNELL = Architecture(
    "flux-schnell",
    label="Flux schnell",
    skeleton=Skeleton(
        "transformer",
        "FluxTransformer2DModel",
        {**_FLUX, "guidance_embeds": False},
        {"text_encoder": CLIP_L, "text_encoder_2": T5_XXL},
        "flux1-schnell transformer config",
    ),
    blocks=FLUX_BLOCKS,
    comfy=ComfyFacets(
        ("FluxSchnell",), _flux_from_comfy, _FLUX_DEPTHS, _FLUX_WIDTHS, skeleton="flux-schnell"
    ),
)
CHROMA_ARCH = Architecture(
    "chroma",
    (CHROMA,),
    label="Chroma",
    takes=("flux",),  # Chroma is a Flux.1-schnell derivative: Flux LoRAs are applied to it
    signature=r"^distilled_guidance_layer",
    skeleton=Skeleton(
        "transformer",
        "ChromaTransformer2DModel",
        dict(
            approximator_hidden_dim=5120,
            approximator_layers=5,
            attention_head_dim=128,
            axes_dims_rope=[16, 56, 56],
            in_channels=64,
            joint_attention_dim=4096,
            num_attention_heads=24,
            num_layers=19,
            num_single_layers=38,
            patch_size=1,
        ),
        {"text_encoder": T5_XXL},
        "chroma transformer config",
    ),
    blocks=BlockMap("chroma", _FLUX_CHAINS),
    comfy=ComfyFacets(("Chroma",), _chroma_from_comfy, skeleton="chroma"),
)
