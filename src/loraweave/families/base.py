"""What every family module provides: load + validate factors, add its delta, give its runtime terms."""

from __future__ import annotations

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


def check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "meta" and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise PartRejected(f"bad tensor: {name} holds NaN or Inf")


def as_float32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(dtype=torch.float32, copy=False)
