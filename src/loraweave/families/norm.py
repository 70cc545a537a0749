"""Norm deltas (LyCORIS `train_norm`: `w_norm`, `b_norm`): weight += s·w_norm, bias += s·b_norm. No alpha.

Targets: LayerNorm and GroupNorm (weight and bias), RMSNorm from torch or diffusers (weight; a `b_norm` needs
a module bias, diffusers RMSNorm(bias=True)). Norm layers are affine in (weight, bias), so the runtime delta
is exact without touching the module: y += s·(x̂ ⊙ w_norm + b_norm), with x̂ the normalised input computed
with the module's own eps / normalized_shape / groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factor


@dataclass
class NormFactors:
    w_norm: torch.Tensor | None  # (C,), stored dtype
    b_norm: torch.Tensor | None  # (C,)
    rank: None = None
    is_conv_kernel: bool = False

    @property
    def rows(self) -> int:
        held = self.w_norm if self.w_norm is not None else self.b_norm
        assert held is not None  # load keeps a part only with w_norm or b_norm
        return held.shape[0]


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> NormFactors:
    extra = sorted(set(tensors) - {"w_norm", "b_norm", "alpha"})
    if extra:
        raise PartRejected(
            "unsupported", f"unsupported: norm delta with {', '.join(key_of[r] for r in extra)}"
        )
    w, b = tensors.get("w_norm"), tensors.get("b_norm")
    if w is None and b is None:
        raise PartRejected("incomplete", "incomplete norm delta: neither w_norm nor b_norm")
    for role in ("w_norm", "b_norm"):
        if role in tensors:
            check_factor(key_of[role], tensors[role])
            if tensors[role].dim() != 1:
                raise PartRejected(
                    "shape_mismatch", f"shape mismatch: {role} {tuple(tensors[role].shape)} is not 1-D"
                )
    if w is not None and b is not None and w.shape != b.shape:
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: w_norm {tuple(w.shape)} vs b_norm {tuple(b.shape)}"
        )
    return NormFactors(w, b)  # a LyCORIS `alpha` (none is written for norms) would be ignored: no scale


def check_target(f: NormFactors, shape: tuple[int, ...]) -> Miss | None:
    if len(shape) != 1:
        return Miss(
            "shape_mismatch", f"shape mismatch: norm delta needs a 1-D norm weight, module weight is {shape}"
        )
    return None


def add_delta(target_rows: torch.Tensor, f: NormFactors, src: int, length: int, coeff: float) -> None:
    """target_rows (length, 1): the 1-D weight viewed as rows."""
    if f.w_norm is not None:
        target_rows.add_(f.w_norm[src : src + length].to(target_rows.dtype).view(length, -1), alpha=coeff)


def bias_delta(f: NormFactors, src: int, length: int) -> torch.Tensor | None:
    return None if f.b_norm is None else f.b_norm[src : src + length]


def _kind(module: torch.nn.Module) -> str | None:
    if isinstance(module, torch.nn.GroupNorm):
        return "group"
    if isinstance(module, torch.nn.LayerNorm):
        return "layer"
    if hasattr(torch.nn, "RMSNorm") and isinstance(module, torch.nn.RMSNorm):
        return "rms_torch"
    if "RMS" in type(module).__name__ and isinstance(getattr(module, "eps", None), float):
        return "rms"  # diffusers RMSNorm: fp32 variance over the last dim
    return None


def normalised(kind: str, module: Any, x: torch.Tensor) -> torch.Tensor:  # a norm layer of `kind`
    """x̂: the module's normalisation without its affine weight and bias."""
    if kind == "group":
        return F.group_norm(x, module.num_groups, None, None, module.eps)
    if kind == "layer":
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)
    if kind == "rms_torch":
        return F.rms_norm(x, module.normalized_shape, None, module.eps)
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    return (x * torch.rsqrt(variance + module.eps)).to(x.dtype)


def runtime_refusal(f: NormFactors, module: Any) -> Miss | None:  # the host or its dequantized view
    """A scale delta recomputes the norm without its affine: only norms loraweave knows how to recompute."""
    if f.w_norm is not None and (module is None or _kind(module) is None):
        return Miss("unsupported", f"norm delta: no runtime form for {type(module).__name__}")
    return None


def runtime_term(f: NormFactors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    bias = bias_delta(f, src, length)
    if f.w_norm is None:
        return RuntimeTerm(None, None, None, bias, dst, length, cost="norm bias delta")
    refused = runtime_refusal(f, module)
    if refused is not None:
        raise PartRejected.of(refused)
    kind = _kind(module)
    assert kind is not None  # runtime_refusal passed
    w = f.w_norm[src : src + length]
    channels_first = kind == "group"
    cache = CastCache(w)

    def fn(x: torch.Tensor, conv: ConvSpec | None) -> torch.Tensor:
        (v,) = cache.get(x)
        xn = normalised(kind, module, x)
        if channels_first:
            return xn[:, dst : dst + length] * v.view(-1, *[1] * (x.dim() - 2))
        return xn[..., dst : dst + length] * v

    return RuntimeTerm.structured(
        dst, length, bias, fn=fn, cost="norm recomputed without affine", caches=(cache,)
    )


SPEC = Family(
    "norm",
    load,
    check_target,
    add_delta=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    uses_alpha_scale=False,
    runtime_refusal=runtime_refusal,
)
