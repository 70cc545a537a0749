"""Full-size models with seeded weights, built without downloads: from the real configs in ../shared/realdata,
on the meta device first, so only the final fp16 storage is ever allocated."""

from __future__ import annotations

import torch

from helpers.common import real_config
from helpers.realsize import assert_seeded, fill_seeded


def _param_seed(seed: int, index: int) -> int:
    return seed * 1_000_003 + index


def seeded_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter with N(0, 1/fan_in) values (1-D: std 0.02) from helpers/realsize.py's seeded pool,
    the i-th parameter in registration order from its own offset (a copy-speed fill: a generator's uniform_
    over 983M values took seconds)."""
    for i, p in enumerate(model.parameters()):
        fill_seeded(p, _param_seed(seed, i))
    return model


def assert_seeded_params(model: torch.nn.Module, seed: int, names: set[str], what: str) -> None:
    """The parameters named in `names` hold exactly the bits `seeded_(model, seed)` wrote."""
    for i, (name, p) in enumerate(model.named_parameters()):
        if name in names:
            assert_seeded(p, _param_seed(seed, i), f"{what}: {name}")


def sd15_unet(dtype: torch.dtype = torch.float16, seed: int = 0) -> torch.nn.Module:
    """The SD1.5 UNet (diffusers UNet2DConditionModel, 860M parameters) at full size, seeded."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(real_config("sd15__unet_config.json")).to(dtype)
    return seeded_(unet.to_empty(device="cpu"), seed).eval().requires_grad_(False)


def sd15_text_encoder(dtype: torch.dtype = torch.float16, seed: int = 1) -> torch.nn.Module:
    """The SD1.5 text encoder (CLIP ViT-L/14 text tower, 123M parameters) at full size, seeded."""
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        te = CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json"))).to(dtype)
    te.to_empty(device="cpu")
    for name, buf in te.named_buffers():  # to_empty leaves buffers uninitialized
        if name.endswith("position_ids"):
            buf.copy_(torch.arange(buf.shape[-1]).expand_as(buf))
    return seeded_(te, seed).eval().requires_grad_(False)
