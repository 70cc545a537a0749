"""The per-sample tests' adapter builder, shared with the region and step tests."""

from __future__ import annotations

import torch

from helpers.arch_matrix import factors


def adapter(model: torch.nn.Module, family: str, seed: int) -> dict[str, torch.Tensor]:
    """A synthetic adapter of `family` on every Linear of `model` (PEFT layout)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for path, m in model.named_modules():
        if type(m) is torch.nn.Linear:
            for suffix, t in factors(family, m.out_features, m.in_features, g).items():
                sd[f"base_model.model.{path}.{suffix}"] = t
    return sd
