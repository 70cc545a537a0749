"""What every family module provides: load + validate factors, add its delta, give its runtime terms."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


class PartRejected(Exception):
    """A part cannot be applied; the message is the reason written into the report."""


@dataclass
class RuntimeTerm:
    """One contribution to a layer's runtime path: y[rows] += coeff * up_rows @ down(x) (or dense)."""

    down: torch.Tensor | None  # (r, in, *k): LoRA down with any Tucker core folded in
    up: torch.Tensor | None  # (length, r)
    dense: torch.Tensor | None  # (length, in, *k) for full diffs
    bias: torch.Tensor | None  # (length,)
    dst_start: int
    length: int


def check_factor(name: str, tensor: torch.Tensor) -> None:
    """Factors must be floating point and finite (meta tensors: shape-only planning, values unknown)."""
    if not tensor.is_floating_point():
        raise PartRejected(f"bad tensor: {name} has dtype {tensor.dtype}, expected floating point")
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return
    try:
        # NaN and ±Inf propagate into min/max: one pass, no bool temporary (isfinite().all() is ~8x slower).
        lo, hi = torch.aminmax(tensor)
        finite = math.isfinite(lo.item()) and math.isfinite(hi.item())
    except RuntimeError:  # dtypes without aminmax on this device (float8)
        finite = bool(torch.isfinite(tensor).all())
    if not finite:
        raise PartRejected(f"bad tensor: {name} holds NaN or Inf")
