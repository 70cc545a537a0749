"""Text encoder configs (transformers classes and the config numbers of the released ones) the catalog
skeletons share."""

from __future__ import annotations

CLIP_L = (
    "CLIPTextModel",
    dict(
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
        num_hidden_layers=12,
        projection_dim=768,
        hidden_act="quick_gelu",
    ),
)

CLIP_H = (
    "CLIPTextModel",
    dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_attention_heads=16,
        num_hidden_layers=23,
        projection_dim=512,
        hidden_act="gelu",
    ),
)

CLIP_G = (
    "CLIPTextModelWithProjection",
    dict(
        hidden_size=1280,
        intermediate_size=5120,
        num_attention_heads=20,
        num_hidden_layers=32,
        projection_dim=1280,
        hidden_act="gelu",
    ),
)

T5_XXL = (
    "T5EncoderModel",
    dict(
        d_model=4096,
        d_ff=10240,
        d_kv=64,
        num_heads=64,
        num_layers=24,
        feed_forward_proj="gated-gelu",
        vocab_size=32128,
    ),
)

QWEN3_06B = (
    "Qwen3Model",
    dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    ),
)
