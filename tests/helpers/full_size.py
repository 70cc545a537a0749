"""Full-size models with seeded weights, built without downloads: from the real configs in ../shared/realdata,
on the meta device first, so only the final fp16 storage is ever allocated."""

from __future__ import annotations

import hashlib

import torch

from helpers.common import real_config


def seeded_(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Fill every parameter uniformly with std 1/sqrt(fan_in) (1-D: 0.02) from one generator, in registration order
    (uniform: a fifth faster than normal in fp16, and a full-size model takes seconds either way)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            bound = 3**0.5 * (p[0].numel() if p.dim() > 1 else 2500) ** -0.5
            p.uniform_(-bound, bound, generator=g)
    return model


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


def digests(model: torch.nn.Module, names: set[str] | None = None) -> dict[str, str]:
    """name -> blake2b of the tensor's bytes, for every parameter and buffer (or those in `names`)."""
    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if names is None or name in names:
            raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
            out[name] = hashlib.blake2b(raw, digest_size=16).hexdigest()
    return out
