"""Small nets and adapter state dicts of the adapter-family tests (LoHa, DoRA, LoKr, OFT, control LoRA),
shared with the LyCORIS and undo tests."""

from __future__ import annotations

import torch
from torch import nn

from helpers.common import (
    gen,
    randn_inputs,
)

TOL = 1e-5


MULTIPLIERS = (1.0, 0.5, -1.0)


LAYERS = ("lin", "c1", "c2", "c3", "pw")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(12, 10)
        self.c1 = nn.Conv1d(4, 6, 3, padding=1)
        self.c2 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.c3 = nn.Conv3d(3, 5, 3, padding=1)
        self.pw = nn.Conv2d(4, 6, 1)  # 1x1 conv: LyCORIS gives it the linear dim/alpha, never Tucker


def inputs() -> dict[str, torch.Tensor]:
    return randn_inputs(
        {"lin": (2, 3, 12), "c1": (2, 4, 9), "c2": (2, 4, 9, 7), "c3": (1, 3, 5, 4, 6), "pw": (2, 4, 5, 5)}
    )


def dora_sd(on_out: bool, seed: int = 4) -> dict[str, torch.Tensor]:
    g = gen(seed)
    d = torch.rand(32, 1, generator=g) + 0.5 if on_out else torch.rand(1, 24, generator=g) + 0.5
    return {
        "lin.lora_down.weight": torch.randn(4, 24, generator=g) * 0.3,
        "lin.lora_up.weight": torch.randn(32, 4, generator=g) * 0.3,
        "lin.alpha": torch.tensor(2.0),
        "lin.dora_scale": d,
    }


def lokr_sd(stem: str, seed: int, alpha: float | None = None, **shapes) -> dict[str, torch.Tensor]:
    g = gen(seed)
    sd = {f"{stem}.lokr_{role}": torch.randn(*shape, generator=g) * 0.5 for role, shape in shapes.items()}
    if alpha is not None:
        sd[f"{stem}.alpha"] = torch.tensor(alpha)
    return sd


def lin_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.ModuleDict({"fc": nn.Linear(20, 24), "cv": nn.Conv2d(8, 16, 3, padding=1)})


def oft_sd(
    seed: int, noise: float = 0.2, alpha: float | None = 0.0, rescale: bool = False
) -> dict[str, torch.Tensor]:
    g = gen(seed)
    sd = {
        "fc.oft_blocks": torch.randn(6, 4, 4, generator=g) * noise,
        "cv.oft_blocks": torch.randn(4, 4, 4, generator=g) * noise,
    }
    if alpha is not None:
        sd |= {"fc.alpha": torch.tensor(alpha), "cv.alpha": torch.tensor(alpha)}
    if rescale:
        sd |= {
            "fc.rescale": 1 + 0.3 * torch.randn(24, 1, generator=g),
            "cv.rescale": 1 + 0.3 * torch.randn(16, 1, 1, 1, generator=g),
        }
    return sd


def _control_lora(base, with_reshape: bool) -> dict[str, torch.Tensor]:
    g = gen(7)
    hidden, inp = base.x_embedder.weight.shape
    sd = {
        "img_in.lora_A.weight": torch.randn(4, 2 * inp, generator=g) * 0.3,
        "img_in.lora_B.weight": torch.randn(hidden, 4, generator=g) * 0.3,
        "img_in.lora_B.bias": torch.randn(hidden, generator=g) * 0.1,
        "double_blocks.0.img_attn.proj.lora_A.weight": torch.randn(4, hidden, generator=g) * 0.3,
        "double_blocks.0.img_attn.proj.lora_B.weight": torch.randn(hidden, 4, generator=g) * 0.3,
    }
    if with_reshape:
        sd["img_in.reshape_weight"] = torch.tensor([hidden, 2 * inp])
    return sd
