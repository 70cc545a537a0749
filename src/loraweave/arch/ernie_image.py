"""ERNIE-Image: diffusers names (behind diffusion_model. / base_model.model. prefixes only)."""

from __future__ import annotations

from .record import Architecture, Layouts, Skeleton

ERNIE_IMAGE = Architecture(
    "ernie-image",
    signature=r"^layers_\d+_(self_attention_(to_[qkv]|to_out_0)|mlp_(gate_proj|up_proj|linear_fc2))$",
    skeleton=Skeleton(
        "transformer",
        "ErnieImageTransformer2DModel",
        {},
        {},
        "ErnieImageTransformer2DModel defaults (24 layers, hidden 3072)",
    ),
    cli_names=("ernie",),
    layouts=Layouts(
        "ernie-image",
        "diffusers names behind diffusion_model. / base_model.model. (prefix only)",
        "ErnieImageLoraLoaderMixin.lora_state_dict",
        "test_arch_anima_sana.py::test_ernie_image_*",
    ),
)
