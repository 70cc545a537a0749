"""The robustness tests' net (with an int8 layer), full adapter and restore checks, shared with the
undo-record tests."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Int8Linear(nn.Module):
    """A Linear-like layer with int8 storage and a per-row scale (a stand-in for a quantized layer)."""

    def __init__(self, in_features: int, out_features: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight", torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
        )
        self.register_buffer("scale", torch.rand(out_features, generator=g) * 0.01 + 0.001)
        self.bias = nn.Parameter(torch.randn(out_features, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.float() * self.scale[:, None], self.bias)


class Net(nn.Module):
    """Small mixed model: fp32/fp16 Linear layers (one without bias), a 3x3 conv, a buffer, a nested block."""

    def __init__(self, seed: int = 0, quant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(6, 6, bias=False)
        self.fp16 = nn.Linear(6, 4).half()
        self.conv = nn.Conv2d(3, 5, 3, padding=1)
        self.block = nn.Module()
        self.block.proj = nn.Linear(6, 6)
        self.register_buffer("running", torch.randn(4))
        if quant:
            self.q = Int8Linear(6, 6, seed=seed + 1)

    def forward(self, x: torch.Tensor, img: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        h = self.block.proj(h)
        if hasattr(self, "q"):
            h = self.q(h)
        y = self.fp16(h.half()).float() + self.running
        return torch.cat([y.flatten(), self.conv(img).flatten()])


def inputs(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 8, generator=g), torch.randn(2, 3, 6, 6, generator=g)


def conv_out(model: nn.Module, seed: int = 7) -> torch.Tensor:
    return model.conv(inputs(seed)[1])


def all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {f"p:{n}": p for n, p in model.named_parameters()}
    out.update({f"b:{n}": b for n, b in model.named_buffers()})
    return out


def assert_untouched(model: nn.Module, before: nn.Module, except_modules: tuple[str, ...] = ()) -> None:
    """Every parameter and buffer bit-identical (dtype included) to `before`, and no hook left behind."""
    now, ref = all_tensors(model), all_tensors(before)
    assert now.keys() == ref.keys()
    for name, tensor in now.items():
        if any(name[2:].startswith(m + ".") for m in except_modules):
            continue
        assert tensor.dtype == ref[name].dtype, name
        assert torch.equal(tensor, ref[name]), f"{name} changed"
    assert_no_hooks(model)


def assert_no_hooks(model: nn.Module) -> None:
    for name, module in model.named_modules():
        assert not module._forward_hooks, f"forward hook left on {name or '<root>'}"
        assert not module._forward_pre_hooks, f"forward pre-hook left on {name or '<root>'}"


def _full_adapter(quant: bool) -> dict[str, torch.Tensor]:
    """Touches every layer of Net: fp32 + bias delta, bias-less fp32, fp16, conv LoCon, nested, diff."""
    g = torch.Generator().manual_seed(21)
    sd = {
        "fc1.lora_A.weight": torch.randn(2, 8, generator=g),
        "fc1.lora_B.weight": torch.randn(6, 2, generator=g),
        "fc1.lora_B.bias": torch.randn(6, generator=g),
        "fc2.lora_down.weight": torch.randn(3, 6, generator=g),
        "fc2.lora_up.weight": torch.randn(6, 3, generator=g),
        "fc2.alpha": torch.tensor(1.5),
        "fp16.lora_down.weight": torch.randn(2, 6, generator=g).half(),
        "fp16.lora_up.weight": torch.randn(4, 2, generator=g).half(),
        "conv.lora_down.weight": torch.randn(2, 3, 3, 3, generator=g),
        "conv.lora_up.weight": torch.randn(5, 2, 1, 1, generator=g),
        "block.proj.diff": torch.randn(6, 6, generator=g) * 0.1,
        "block.proj.diff_b": torch.randn(6, generator=g) * 0.1,
    }
    if quant:
        sd["q.lora_down.weight"] = torch.randn(2, 6, generator=g)
        sd["q.lora_up.weight"] = torch.randn(6, 2, generator=g)
    return sd


N_MODULES = 5  # fc1, fc2, fp16, conv, block.proj (+ q when quant)


def _check_restored(
    model: nn.Module, before: nn.Module, out_before: torch.Tensor, conv_before: torch.Tensor
) -> None:
    assert_untouched(model, before)
    with torch.no_grad():
        assert torch.equal(model(*inputs()), out_before)
        assert torch.equal(conv_out(model), conv_before)


def _snapshot(model):
    with torch.no_grad():
        return copy.deepcopy(model), model(*inputs()), conv_out(model)
