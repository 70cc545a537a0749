"""A LoRA made by peft itself (the parity reference), and the error measure of the parity tests."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model_state_dict

from helpers.tiny_models import MODELS


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.detach(), ref.detach()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _targets(model: torch.nn.Module, with_conv: bool) -> list[str]:
    kinds = (torch.nn.Linear, torch.nn.Conv2d) if with_conv else (torch.nn.Linear,)
    return [n for n, m in model.named_modules() if isinstance(m, kinds)]


def make_peft_lora(arch: str, tmp_path, seed: int = 3):
    """Inject a random PEFT LoRA (r=4, alpha=8, with an alpha_pattern) and save it the diffusers way."""
    build, forward, component = MODELS[arch]
    base = build()
    peft_model = copy.deepcopy(base)
    cfg = LoraConfig(
        r=4,
        lora_alpha=8,
        alpha_pattern={"to_k": 2},
        init_lora_weights=False,
        target_modules=_targets(base, with_conv=arch == "sdxl_unet"),
    )
    torch.manual_seed(seed)
    peft_model.add_adapter(cfg)
    sd = get_peft_model_state_dict(peft_model)
    if arch == "sdxl_unet":
        from diffusers import StableDiffusionXLPipeline as Pipe

        Pipe.save_lora_weights(tmp_path, unet_lora_layers=sd, unet_lora_adapter_metadata=cfg.to_dict())
    else:
        from diffusers import FluxPipeline as Pipe

        Pipe.save_lora_weights(
            tmp_path, transformer_lora_layers=sd, transformer_lora_adapter_metadata=cfg.to_dict()
        )
    return base, peft_model, tmp_path / "pytorch_lora_weights.safetensors", forward
