"""A tiny CLIP text encoder, a LoRA for it and its expected delta."""

from __future__ import annotations

import torch


def _lora(sd: dict, stem: str, module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    out, inp = module.weight.shape
    sd[f"{stem}.lora_down.weight"] = torch.randn(2, inp, generator=g)
    sd[f"{stem}.lora_up.weight"] = torch.randn(out, 2, generator=g)
    sd[f"{stem}.alpha"] = torch.tensor(1.0)


def _delta(sd: dict, stem: str) -> torch.Tensor:
    return 0.5 * sd[f"{stem}.lora_up.weight"] @ sd[f"{stem}.lora_down.weight"]


def tiny_clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    return CLIPTextModel(
        CLIPTextConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            vocab_size=64,
            max_position_embeddings=8,
        )
    ).eval()
