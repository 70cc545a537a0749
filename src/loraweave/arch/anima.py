"""Anima (Cosmos-Predict2 DiT + LLM adapter): original (circlestone-labs, ComfyUI, kohya) names -> diffusers
modules.

Source: diffusers `_convert_non_diffusers_anima_lora_to_diffusers` (substring renames, in its order, on the
CosmosTransformer3DModel names). Its `llm_adapter.` modules are a pipeline component of their own
(`text_conditioner`, an AnimaTextConditioner) whose module names are the original ones: only the prefix
differs, which the key parser routes (`diffusion_model.llm_adapter.`, kohya `lora_unet_llm_adapter_`). kohya
files name the Qwen3 text encoder under `lora_te_` with Qwen3Model's own module names.
"""

from __future__ import annotations

from .encoders import QWEN3_06B
from .record import Architecture, ComfyFacets, Depths, Layouts, Skeleton
from .spec import ArchTable

ANIMA = ArchTable(
    name="anima",
    classes=("CosmosTransformer3DModel",),
    aliases=(),
    renames=(
        ("blocks.", "transformer_blocks."),
        ("adaln_modulation_self_attn.1", "norm1.linear_1"),
        ("adaln_modulation_self_attn.2", "norm1.linear_2"),
        ("adaln_modulation_cross_attn.1", "norm2.linear_1"),
        ("adaln_modulation_cross_attn.2", "norm2.linear_2"),
        ("adaln_modulation_mlp.1", "norm3.linear_1"),
        ("adaln_modulation_mlp.2", "norm3.linear_2"),
        ("self_attn.q_proj", "attn1.to_q"),
        ("self_attn.k_proj", "attn1.to_k"),
        ("self_attn.v_proj", "attn1.to_v"),
        ("self_attn.output_proj", "attn1.to_out.0"),
        ("cross_attn.q_proj", "attn2.to_q"),
        ("cross_attn.k_proj", "attn2.to_k"),
        ("cross_attn.v_proj", "attn2.to_v"),
        ("cross_attn.output_proj", "attn2.to_out.0"),
        ("mlp.layer1", "ff.net.0.proj"),
        ("mlp.layer2", "ff.net.2"),
        ("final_layer.adaln_modulation.1", "norm_out.linear_1"),
        ("final_layer.adaln_modulation.2", "norm_out.linear_2"),
        ("final_layer.linear", "proj_out"),
        ("t_embedder.1", "time_embed.t_embedder"),
        ("t_embedding_norm", "time_embed.norm"),
        ("x_embedder.proj.1", "patch_embed.proj"),
    ),
)

# Cosmos-Predict2-2B, the DiT Anima reuses (hidden 2048, 28 blocks, 1024-wide text embeddings, no learnable
# pos).
_ANIMA_DIT = dict(
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=28,
    text_embed_dim=1024,
    rope_scale=[1.0, 4.0, 4.0],
    extra_pos_embed_type=None,
)


def _cosmos_predict2_from_comfy(cfg: dict) -> dict:
    # ComfyUI's MiniTrainDIT (Cosmos-Predict2 and Anima's DiT); the extra per-block position embedding is
    # diffusers' "learnable" one.
    heads = cfg.get("num_heads", 16)
    return {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg["out_channels"],
        "num_attention_heads": heads,
        "attention_head_dim": cfg.get("model_channels", 2048) // heads,
        "num_layers": cfg.get("num_blocks", 28),
        "mlp_ratio": cfg.get("mlp_ratio", 4.0),
        "text_embed_dim": cfg.get("crossattn_emb_channels", 1024),
        "adaln_lora_dim": cfg.get("adaln_lora_dim", 256),
        "max_size": (cfg.get("max_frames", 128), cfg.get("max_img_h", 240), cfg.get("max_img_w", 240)),
        "patch_size": (
            cfg.get("patch_temporal", 1),
            cfg.get("patch_spatial", 2),
            cfg.get("patch_spatial", 2),
        ),
        "concat_padding_mask": bool(cfg.get("concat_padding_mask", True)),
        "extra_pos_embed_type": "learnable" if cfg.get("extra_per_block_abs_pos_emb") else None,
    }


# Anima-2.9B (Gazingstars123) is a LLaMA-Pro block expansion of Anima's 28 blocks to 40: its
# expand_manifest.json lists the new blocks (quoted in sd-webui-forge-classic #1401; the converter of
# AUTOMATIC1111/stable-diffusion-webui-extensions #437 maps 0->0, 2->3, 14->20, 27->39). Anima-3.8B's 52
# blocks have no published manifest (ComfyUI-Lora-Manager #1104 reconstructed one by cosine similarity), so
# files of another depth than a 52-block model's are refused.
ANIMA_DEPTHS = Depths(
    chain="transformer_blocks",
    path=r"^(?:net[._])?(?:transformer_)?blocks[._](?P<index>\d+)(?=[._])",
    known=(28, 40, 52),
    inserted={(28, 40): (2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36)},
    source="Anima-2.9B expand_manifest.json (sd-webui-forge-classic #1401, #1453)",
)

ANIMA_ARCH = Architecture(
    "anima",
    (ANIMA,),
    label="Anima",
    signature=r"^blocks_\d+_(self_attn|cross_attn)_[qkvo]_proj|^blocks_\d+_mlp_layer",
    skeleton=Skeleton(
        "transformer",
        "CosmosTransformer3DModel",
        _ANIMA_DIT,
        {"text_encoder": QWEN3_06B},
        "Cosmos-Predict2-2B DiT config (Anima's), AnimaTextConditioner defaults, Qwen3-0.6B encoder",
        {"text_conditioner": ("AnimaTextConditioner", {})},
    ),
    layouts=Layouts(
        "anima (Cosmos-Predict2 + LLM adapter)",
        "Anima/ComfyUI names (diffusion_model.; llm_adapter. -> text_conditioner "
        "component), kohya lora_unet_ (+ llm_adapter) and lora_te_ (Qwen3), sd-scripts' text_encoder.qwen3.",
        "_convert_non_diffusers_anima_lora_to_diffusers",
        "test_arch_anima_sana.py::test_anima_*",
    ),
    comfy=ComfyFacets(
        # Cosmos-Predict2 is Anima's DiT without the LLM adapter: the same diffusers class and table.
        ("Anima", "CosmosT2IPredict2", "CosmosI2VPredict2"),
        _cosmos_predict2_from_comfy,
        skeleton="anima",
    ),
    depths=ANIMA_DEPTHS,
)
