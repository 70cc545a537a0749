"""The small net, LoRA and state checks of the hostile-input tests, shared with the journal tests."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = nn.Linear(8, 8).to(dtype)
        self.fc2 = nn.Linear(8, 8).to(dtype)
        self.fc3 = nn.Linear(8, 8).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)))


def lora(layers, seed: int, rank: int = 2, scale: float = 0.3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in layers:
        out[f"{name}.lora_A.weight"] = torch.randn(rank, 8, generator=g) * scale
        out[f"{name}.lora_B.weight"] = torch.randn(8, rank, generator=g) * scale
    return out


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], before[k]) for k in before)


def no_hooks(model: nn.Module) -> bool:
    return all(not m._forward_hooks and "forward" not in m.__dict__ for m in model.modules())
