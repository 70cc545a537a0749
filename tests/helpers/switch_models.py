"""The switching tests' layer names and LoRA builder, shared with the offload and stack-select tests."""

from __future__ import annotations

import torch

from helpers.common import gen

LAYERS = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.1.ff.net.2",
    "single_transformer_blocks.0.proj_out",
    "single_transformer_blocks.1.proj_mlp",
]


def _lora(model, modules, seed: int) -> dict[str, torch.Tensor]:
    g = gen(seed)
    sd = {}
    for path in modules:
        w = model.get_submodule(path).weight
        sd[f"transformer.{path}.lora_A.weight"] = torch.randn(4, w.shape[1], generator=g) * 0.3
        sd[f"transformer.{path}.lora_B.weight"] = torch.randn(w.shape[0], 4, generator=g) * 0.3
    return sd
