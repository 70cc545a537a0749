"""Tiny configs of real architectures (diffusers classes and their kwargs, or builders), shared by the arch,
detect, support-matrix and batch tests."""

from __future__ import annotations

import torch


def tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )


def tiny_wan(i2v: bool):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    extra = {"image_dim": 24, "added_kv_proj_dim": 32} if i2v else {}
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        **extra,
    )


def tiny_wan_vace():
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(0)
    return WanVACETransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=4,
        out_channels=4,
        text_dim=24,
        freq_dim=16,
        ffn_dim=64,
        num_layers=3,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        vace_layers=[0, 2],
        vace_in_channels=8,
    )


def tiny_lumina2():
    from diffusers import Lumina2Transformer2DModel

    torch.manual_seed(0)
    return Lumina2Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        hidden_size=64,
        num_layers=2,
        num_refiner_layers=1,
        num_attention_heads=4,
        num_kv_heads=2,
        multiple_of=16,
        axes_dim_rope=(4, 6, 6),
        axes_lens=(16, 16, 16),
        cap_feat_dim=16,
    )


# Cosmos-Predict2-2B, the DiT Anima reuses (hidden 2048, 28 blocks, 1024-wide text embeddings, no learnable
# pos).
ANIMA_DIT = dict(
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=28,
    text_embed_dim=1024,
    rope_scale=(1.0, 4.0, 4.0),
    extra_pos_embed_type=None,
)


ANIMA_DIT_TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=12,
    num_layers=2,
    text_embed_dim=12,
    adaln_lora_dim=4,
    max_size=(4, 8, 8),
    extra_pos_embed_type=None,
)


SANA_TINY = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_cross_attention_heads=2,
    cross_attention_head_dim=8,
    cross_attention_dim=16,
    caption_channels=8,
    sample_size=8,
)


ERNIE_TINY = dict(
    hidden_size=16,
    num_attention_heads=2,
    num_layers=2,
    ffn_hidden_size=32,
    in_channels=4,
    out_channels=4,
    text_in_dim=8,
    rope_axes_dim=(2, 2, 4),
)


CLASSES = {
    "flux2": "Flux2Transformer2DModel",
    "hunyuan": "HunyuanVideoTransformer3DModel",
    "krea2": "Krea2Transformer2DModel",
}


def _build(arch: str, dtype=torch.float32, **config):
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, CLASSES[arch])(**config)
    model = model.to(dtype).to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # distinct rows everywhere (cheaper than a full randn at HunyuanVideo's 3072 width)
        for p in model.parameters():
            rows = torch.randn(p.shape[0], *[1] * (p.dim() - 1), generator=g)
            p.copy_(
                rows + torch.randn(1, *p.shape[1:], generator=g)
                if p.dim() > 1
                else torch.randn(p.shape, generator=g)
            )
    return model


TINY = {
    "flux2": lambda: _build(
        "flux2",
        patch_size=1,
        in_channels=4,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        timestep_guidance_channels=16,
        axes_dims_rope=(2, 2, 2, 2),
    ),
    # The converter hard-codes hidden_size 3072 for single-block linear1: the smallest model it accepts is
    # 3072 wide.
    "hunyuan": lambda: _build(
        "hunyuan",
        torch.bfloat16,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        mlp_ratio=0.25,
        text_embed_dim=16,
        pooled_projection_dim=16,
    ),
    "krea2": lambda: _build(
        "krea2",
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        timestep_embed_dim=16,
        text_hidden_dim=16,
        num_text_layers=3,
        text_num_attention_heads=2,
        text_num_key_value_heads=1,
        text_intermediate_size=24,
        num_layerwise_text_blocks=2,
        num_refiner_text_blocks=1,
        axes_dims_rope=(2, 2, 4),
    ),
}


LTX2_FULL = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True)


LTX2_TINY = dict(
    in_channels=8,
    out_channels=8,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=8,
    audio_out_channels=8,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,
    num_layers=2,
    caption_channels=12,
    **LTX2_FULL,
)
