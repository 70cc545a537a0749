"""ERNIE-Image: diffusers names (behind diffusion_model. / base_model.model. prefixes only)."""

from __future__ import annotations

from .record import Architecture, ComfyFacets, Layouts, Skeleton

# ComfyUI's ErnieImageModel keyword defaults: its detection writes none of them (the released model's widths).
_ERNIE = {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
          "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072, "rope_theta": 256,
          "rope_axes_dim": (32, 48, 48), "eps": 1e-6, "qk_layernorm": True}  # fmt: skip


def _ernie_image_from_comfy(cfg: dict) -> dict:
    return {k: cfg.get(k, default) for k, default in _ERNIE.items()}


ERNIE_IMAGE = Architecture(
    "ernie-image",
    label="ERNIE-Image",
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
    comfy=ComfyFacets(("ErnieImage",), _ernie_image_from_comfy, skeleton="ernie-image"),
)
