"""The support matrix's architectures (tiny configs) and the LoRA factors it builds for each, shared with the
batch and per-sample tests."""

from __future__ import annotations

import torch

from helpers.tiny_configs import (
    ANIMA_DIT_TINY,
    ERNIE_TINY,
    LTX2_TINY,
    SANA_TINY,
    tiny_lumina2,
    tiny_sd3,
    tiny_wan,
    tiny_wan_vace,
)
from helpers.tiny_configs import TINY as DITS2
from helpers.tiny_models import MODELS


def _tiny(cls_name: str, **config):
    import diffusers

    torch.manual_seed(0)
    return getattr(diffusers, cls_name)(**config).eval()


# HunyuanVideo is left out: diffusers' converter forces a 3072-wide model (see test_arch_dits2), too big per
# cell.
ARCHS = {
    "flux": MODELS["flux"][0],
    "chroma": lambda: _tiny(
        "ChromaTransformer2DModel",
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
        approximator_num_channels=8,
        approximator_hidden_dim=16,
        approximator_layers=1,
    ),
    "qwen-image": lambda: _tiny(
        "QwenImageTransformer2DModel",
        in_channels=8,
        out_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
    ),
    "flux2": DITS2["flux2"],
    "krea2": DITS2["krea2"],
    "z-image": MODELS["zimage"][0],
    "sdxl-unet": MODELS["sdxl_unet"][0],
    "sd3": tiny_sd3,
    "wan": lambda: tiny_wan(True),
    "wan-vace": tiny_wan_vace,
    "ltx2": lambda: _tiny("LTX2VideoTransformer3DModel", **LTX2_TINY),
    "lumina2": tiny_lumina2,
    "anima": lambda: _tiny("CosmosTransformer3DModel", **ANIMA_DIT_TINY),
    "sana": lambda: _tiny("SanaTransformer2DModel", **SANA_TINY),
    "ernie-image": lambda: _tiny("ErnieImageTransformer2DModel", **ERNIE_TINY),
    "ltx-video": lambda: _tiny(
        "LTXVideoTransformer3DModel",
        in_channels=8,
        out_channels=8,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    ),
    "pixart": lambda: _tiny(
        "PixArtTransformer2DModel",
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=1,
        cross_attention_dim=16,
        sample_size=8,
        caption_channels=16,
    ),
}


def _divisor(n: int, want: int) -> int:
    return max(d for d in range(1, want + 1) if n % d == 0)


def factors(family: str, out: int, inp: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Suffix -> tensor for one layer of shape (out, inp); random, small, never zero."""
    r = 2

    def rnd(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    lora = {
        "lora_down.weight": rnd(r, inp, scale=1.0),
        "lora_up.weight": rnd(out, r),
        "alpha": torch.tensor(1.0),
    }
    if family == "lora":
        return lora
    if family == "dora":
        return {**lora, "dora_scale": 1.0 + rnd(out, 1)}
    if family == "loha":
        return {
            "hada_w1_a": rnd(out, r, scale=0.3),
            "hada_w1_b": rnd(r, inp, scale=1.0),
            "hada_w2_a": rnd(out, r, scale=0.3),
            "hada_w2_b": rnd(r, inp, scale=1.0),
            "alpha": torch.tensor(2.0),
        }
    if family == "lokr":
        a, c = _divisor(out, 4), _divisor(inp, 4)
        return {
            "lokr_w1": rnd(a, c, scale=1.0),
            "lokr_w2": rnd(out // a, inp // c),
            "alpha": torch.tensor(1.0),
        }
    if family == "oft":
        b = _divisor(out, 8)
        return {"oft_blocks": rnd(out // b, b, b, scale=0.5), "alpha": torch.tensor(0.0)}
    if family == "ia3":
        return {"weight": rnd(out, scale=0.5), "on_input": torch.tensor(0)}
    if family == "glora":
        return {
            "a1.weight": rnd(inp, r),
            "a2.weight": rnd(r, inp),
            "b1.weight": rnd(out, r),
            "b2.weight": rnd(r, inp),
            "alpha": torch.tensor(2.0),
        }
    return {"diff": rnd(out, inp, scale=0.01), "diff_b": rnd(out, scale=0.01)}
