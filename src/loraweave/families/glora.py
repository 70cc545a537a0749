"""GLoRA (`a1`, `a2`, `b1`, `b2` `.weight`, `alpha`): ΔW = W·A + B, read from the original weight W.

LyCORIS >= 3 naming: a1 (in, r), a2 (r, in), b1 (out, r), b2 (r, in, *k): ΔW = W·(a1·a2) + b1·b2, with
W·(a1·a2) mixing input channels only (conv: einsum over `in`, the kernel untouched). Pre-3.0 naming: a1 (r,
in), a2 (in, r), b1 (r, in), b2 (out, r): ΔW = b2·b1 + W·a2·a1; both are held in the new convention here.
The naming is read from where r sits. On a square layer both patterns fit the factor shapes; the module's
input width then decides (r == in == out: the current naming). γ = alpha / r.
Runtime is exact: Linear: a rank-2r pair, down = [a2; b2], up = [W·a1, b1] (W·a1 built once, in fp32);
conv: y += W∗(a1·a2·x) + b1·(b2∗x), the first product by the layer's own weight."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factors

_ROLES = ("a1", "a2", "b1", "b2")


@dataclass
class GloraFactors:
    a_in: torch.Tensor  # (in, r[, 1..]): LyCORIS>=3 a1; old a2
    a_out: torch.Tensor  # (r, in[, 1..]): LyCORIS>=3 a2; old a1
    b_up: torch.Tensor  # (rows, r[, 1..])
    b_down: torch.Tensor  # (r, in, *k) or flattened (r, in*k)
    old_naming: bool
    other: tuple[torch.Tensor, ...] | None  # the other naming's (a_in, a_out, b_up, b_down) while undecided

    @property
    def rank(self) -> int:
        return self.a_out.shape[0]

    @property
    def rows(self) -> int:
        return self.b_up.shape[0]

    @property
    def is_conv_kernel(self) -> bool:
        return any(d > 1 for d in self.b_down.shape[2:])


def _fits(a_in: torch.Tensor, a_out: torch.Tensor, b_up: torch.Tensor, b_down: torch.Tensor) -> bool:
    r, n = a_out.shape[0], a_in.shape[0]
    ones = all(d == 1 for t in (a_in, a_out, b_up) for d in t.shape[2:])
    cols = b_down.shape[1] == n or (b_down.dim() == 2 and b_down.shape[1] % n == 0)  # conv b2 may come flat
    return ones and cols and a_in.shape[1] == b_up.shape[1] == b_down.shape[0] == r and a_out.shape[1] == n


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> GloraFactors:
    missing = [r for r in _ROLES if r not in tensors]
    if missing:
        raise PartRejected(
            "incomplete", f"incomplete GLoRA: no {', '.join(f'{r}.weight' for r in missing)} tensor"
        )
    extra = sorted(set(tensors) - set(_ROLES))
    if extra:  # e.g. a Tucker `bm` or a `dora_scale`: applying the rest alone would be wrong
        raise PartRejected("unsupported", f"unsupported: GLoRA with {', '.join(key_of[r] for r in extra)}")
    check_factors(tensors, key_of)
    a1, a2, b1, b2 = (tensors[r] for r in _ROLES)
    if any(t.dim() < 2 for t in (a1, a2, b1, b2)):
        raise PartRejected("shape_mismatch", "shape mismatch: GLoRA factors must be at least 2-D")
    new = (a1, a2, b1, b2) if _fits(a1, a2, b1, b2) else None
    old = (a2, a1, b2, b1) if _fits(a2, a1, b2, b1) else None
    if new is None and old is None:
        shapes = ", ".join(f"{r} {tuple(t.shape)}" for r, t in zip(_ROLES, (a1, a2, b1, b2), strict=True))
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: GLoRA factors do not pair in either naming ({shapes})"
        )
    first = new if new is not None else old
    assert first is not None  # one naming pairs (refused above otherwise)
    return GloraFactors(*first, new is None, old if new is not None and old is not None else None)


def check_target(f: GloraFactors, shape: tuple[int, ...]) -> Miss | None:
    if len(shape) < 2:
        return Miss(
            "shape_mismatch", f"shape mismatch: GLoRA needs a Linear or Conv weight, module weight is {shape}"
        )
    if f.a_in.shape[0] != shape[1] or f.b_down[0].numel() != math.prod(shape[1:]):
        return Miss(
            "shape_mismatch",
            f"shape mismatch: GLoRA input (a {f.a_in.shape[0]}, b {tuple(f.b_down.shape[1:])}) vs module "
            f"{shape[1:]}",
        )
    if f.old_naming and math.prod(shape[2:]) > 1:
        return Miss(
            "unsupported", "unsupported: pre-3.0 GLoRA naming on a conv with a kernel > 1 (no producer known)"
        )
    return None


def settle(f: GloraFactors, shape: tuple[int, ...]) -> GloraFactors:
    """Square layer, both namings fit the tensors: the module's input width decides."""
    if f.other is None or len(shape) < 2:
        return f
    if f.a_in.shape[0] != shape[1] and f.other[0].shape[0] == shape[1]:
        return dataclasses.replace(
            f,
            a_in=f.other[0],
            a_out=f.other[1],
            b_up=f.other[2],
            b_down=f.other[3],
            old_naming=True,
            other=None,
        )
    return dataclasses.replace(f, other=None)


def _a_delta(base: torch.Tensor, f: GloraFactors) -> torch.Tensor:
    """W·(a_in·a_out) on (rows, in*k) weight rows, mixing input channels only."""
    a_in, a_out = f.a_in.flatten(1).to(base.dtype), f.a_out.flatten(1).to(base.dtype)
    n, kk = a_in.shape[0], base.shape[1] // a_in.shape[0]
    if kk == 1:
        return base @ a_in @ a_out
    per_tap = base.view(base.shape[0], n, kk).transpose(1, 2)  # (rows, kk, in)
    return (per_tap @ a_in @ a_out).transpose(1, 2).reshape(base.shape[0], -1)


def add_delta(
    target_rows: torch.Tensor,
    f: GloraFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor | None = None,
    **_: object,
) -> None:
    """target_rows (length, in*k) += coeff · (W_rows·a_in·a_out + b_up[src:src+length]·b_down); base =
    W_rows."""
    if base is None:
        raise ValueError("GLoRA reads the original weight: add_delta needs base=")
    dt = target_rows.dtype
    target_rows.add_(_a_delta(base, f), alpha=coeff)
    target_rows.addmm_(f.b_up[src : src + length].flatten(1).to(dt), f.b_down.flatten(1).to(dt), alpha=coeff)


def bias_delta(f: GloraFactors, src: int, length: int) -> None:
    return None


def plain_weight(module: Any) -> torch.Tensor | None:
    """The module's weight when it is an ordinary floating tensor (not quantized, not offloaded), else
    None."""
    w: Any = getattr(module, "weight", None)
    plain = (
        type(w) in (torch.Tensor, torch.nn.Parameter) and w.is_floating_point() and w.device.type != "meta"
    )
    return w if plain else None


def layer_product(module: Any, h: torch.Tensor, conv: ConvSpec | None, dst: int, length: int) -> torch.Tensor:
    """Output rows [dst, dst+length) of the host layer applied to h, without bias (W·h, or W∗h for conv)."""
    w = plain_weight(module)
    if w is not None:
        w = w[dst : dst + length].to(h.device, h.dtype)
        return conv.fn(h, w, None, **conv.kwargs) if conv is not None else F.linear(h, w)
    out: torch.Tensor = type(module).forward(
        module, h
    )  # class forward: skips hooks and instance-level forward overrides
    bias = getattr(module, "bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.to(out.device, out.dtype)
        out = out - (b.view(-1, *([1] * (out.dim() - 2))) if conv is not None else b)
    return out[:, dst : dst + length] if conv is not None else out[..., dst : dst + length]


def runtime_term(f: GloraFactors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    if module is None:
        raise RuntimeError(
            "GLoRA runtime needs the host module (runtime_term(..., module=)): W·a1·a2·x reads W"
        )
    acc = torch.float64 if f.a_in.dtype == torch.float64 else torch.float32
    a_in, a_out = f.a_in.flatten(1).to(acc), f.a_out.flatten(1).to(acc)
    b_up = f.b_up[src : src + length].flatten(1).to(acc)
    weight = plain_weight(module)
    if not isinstance(module, torch.nn.modules.conv._ConvNd):
        if weight is not None:
            w_a = weight.detach()[dst : dst + length].to(acc) @ a_in
        else:  # quantized / wrapped weight: let the layer itself compute (a_inᵀ·Wᵀ)ᵀ
            with torch.no_grad():
                w_a = layer_product(module, a_in.t().contiguous(), None, dst, length).to(acc).t()
        down = torch.cat([a_out, f.b_down.flatten(1).to(acc)])
        cost = f"GLoRA as a rank-{2 * f.rank} pair (W·a1 cached)"
        return RuntimeTerm(down, torch.cat([w_a, b_up], dim=1), None, None, dst, length, cost=cost)
    kernel = tuple(module.weight.shape[2:])
    b_down = f.b_down.reshape(f.rank, a_in.shape[0], *kernel).to(acc)
    cache = CastCache(a_in, a_out, b_up, b_down)

    def fn(x: torch.Tensor, conv: ConvSpec) -> torch.Tensor:
        ai, ao, bu, bd = cache.get(x)
        mixed = torch.movedim(torch.movedim(x, 1, -1) @ ao.t() @ ai.t(), -1, 1)
        hb = conv.fn(x, bd, None, **conv.kwargs)
        return layer_product(module, mixed, conv, dst, length) + conv.fn(
            hb, bu.view(*bu.shape, *[1] * len(kernel))
        )

    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        cost="GLoRA conv: extra layer conv on a1·a2·x",
        caches=(cache,),
    )


SPEC = Family(
    "glora",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    settle=settle,
)
