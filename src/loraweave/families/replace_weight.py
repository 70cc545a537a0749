"""Weight replacement (`set_weight`; BFL control LoRAs' `*_norm.scale`): W ← t outright. Strength is ignored
(the replacement is not a delta to scale), as every loader that supports it does; the report says so.

Merge writes t − W_original; runtime adds (t − W)·x for Linear-like layers and x̂ ⊙ (t − w) for norm layers,
reading the layer's current weight."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factor
from .norm import _kind, normalised


@dataclass
class SetFactors:
    weight: torch.Tensor
    rank: None = None
    is_conv_kernel: bool = False

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> SetFactors:
    if "set_weight" not in tensors:
        raise PartRejected("incomplete", "incomplete replacement: no set_weight tensor")
    check_factor(key_of["set_weight"], tensors["set_weight"])
    if tensors["set_weight"].dim() == 0:
        raise PartRejected("shape_mismatch", f"shape mismatch: {key_of['set_weight']} is a scalar")
    return SetFactors(tensors["set_weight"])


def check_target(f: SetFactors, shape: tuple[int, ...]) -> Miss | None:
    if tuple(f.weight.shape[1:]) != tuple(shape[1:]):
        return Miss(
            "shape_mismatch", f"shape mismatch: replacement {tuple(f.weight.shape)} vs module weight {shape}"
        )
    return None


def add_delta(
    target_rows: torch.Tensor,
    f: SetFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor,
    strength: float | None = None,
    scale: float | None = None,
) -> None:
    new = f.weight[src : src + length].reshape(length, -1).to(target_rows.dtype)
    if torch.equal(target_rows, base):  # alone on these rows: write t itself (W + (t − W) is not exactly t)
        target_rows.copy_(new)
    else:
        target_rows.add_(new - base)  # strength deliberately ignored: W ← t


def bias_delta(f: SetFactors, src: int, length: int) -> None:
    return None


def runtime_refusal(f: SetFactors, module: Any) -> Miss | None:  # the host or its dequantized view
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.device.type == "meta":
        return Miss("unsupported", "weight replacement at runtime reads the layer's plain floating weight")
    if weight.dim() == 1 and _kind(module) is None:
        return Miss("unsupported", f"weight replacement: no runtime form for {type(module).__name__}")
    return None


def runtime_term(f: SetFactors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    refused = runtime_refusal(f, module)
    if refused is not None:
        raise PartRejected.of(refused)
    weight = module.weight
    kind = _kind(module) if weight.dim() == 1 else None
    cache = CastCache(f.weight[src : src + length])  # held: a host counts and moves it

    def fn(
        x: torch.Tensor,
        conv: ConvSpec | None,
        base: torch.Tensor | None = None,
        strength: float | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        w = weight[dst : dst + length]
        diff: torch.Tensor = cache.to(x.device, x.dtype)[0] - w.to(x.device, x.dtype)
        if kind is not None:
            xn = normalised(kind, module, x)
            if kind == "group":
                return xn[:, dst : dst + length] * diff.view(-1, *[1] * (x.dim() - 2))
            return xn[..., dst : dst + length] * diff
        if conv is not None:
            return conv.fn(x, diff, None, **conv.kwargs)
        return F.linear(x, diff)

    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        linear_in_strength=False,
        cost="replacement: strength ignored, dense (t − W) product",
        caches=(cache,),
    )


SPEC = Family(
    "set",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    roles=("set_weight",),
    uses_alpha_scale=False,
    runtime_refusal=runtime_refusal,
)
