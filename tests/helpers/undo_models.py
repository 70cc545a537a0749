"""A tiny net, its LoRA and bit-exact state checks of the undo-record tests, shared with the CUDA undo
tests."""

from __future__ import annotations

import torch
from torch import nn

from helpers.common import gen
from loraweave.mechanisms.merge.undo import bits


def state_bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: bits(v.detach()).clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def assert_same_bits(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = state_bits(model)
    assert now.keys() == before.keys()
    for k, v in now.items():
        assert v.dtype == before[k].dtype and torch.equal(v, before[k]), f"{k} differs bitwise"


def net(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Linear layers of one dtype, wide enough for compact records to pay; a signed zero in the weight."""
    torch.manual_seed(seed)
    model = nn.ModuleDict({"a": nn.Linear(96, 80), "b": nn.Linear(80, 64, bias=False)}).to(dtype)
    with torch.no_grad():
        model.a.weight[0, :4] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    return model


def lora_sd(model: nn.Module, rel: float = 0.02, seed: int = 1, rank: int = 4) -> dict[str, torch.Tensor]:
    """A LoRA with ‖ΔW‖ ≈ rel·‖W‖ on every Linear (a typical trained LoRA's order of magnitude)."""
    g = gen(seed)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            a = torch.randn(rank, m.in_features, generator=g)
            b = torch.randn(m.out_features, rank, generator=g)
            b *= rel * m.weight.float().norm() / (b @ a).norm()
            sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = a, b
    return sd


def kinds_of(handle) -> set[str]:
    return {m.undo for m in handle.report.applied if m.mechanism == "merge"}


def overflowing_model(dtype: torch.dtype, rows: int = 40, cols: int = 16) -> tuple[nn.Module, dict]:
    """Values near the dtype's largest in the last rows only, and a LoRA that pushes them past it (and barely
    moves the other rows: their misses are few, so no copy is decided from a sample before the pass)."""
    model = nn.ModuleDict({"a": nn.Linear(cols, rows, bias=False)}).to(dtype)
    big = torch.finfo(dtype).max
    with torch.no_grad():
        model.a.weight.normal_(0, 0.1, generator=gen(2))
        model.a.weight[-3:] = big * 0.99
    up = torch.full((rows, 1), 1e-3)
    up[-3:] = 0.05 * big
    return model, {"a.lora_A.weight": torch.ones(1, cols), "a.lora_B.weight": up}
