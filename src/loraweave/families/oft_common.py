"""Helpers shared by the OFT variants (LyCORIS/kohya OFT, BOFT, PEFT OFT): Cayley map, constraint, rescale.

The variant of an "oft" part is chosen by the planner from its keys and shapes (families.family_for); the
variants never call each other."""

from __future__ import annotations

import torch

from .base import PartRejected

RESCALE_FOLLOWS_STRENGTH = (
    False  # False: LyCORIS (rescale in full at any strength); True: 1 + s·(rescale − 1)
)


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def cayley(blocks: torch.Tensor, constraint: float, dtype: torch.dtype) -> torch.Tensor:
    """LyCORIS's R = (I + Q)(I − Q)⁻¹ for Q = B − Bᵀ, Q scaled onto the sphere ‖Q‖ = c when c > 0 and it lies
    outside."""
    b = blocks.to(dtype)
    q = b - b.transpose(-1, -2)
    if constraint > 0:
        norm = float(torch.linalg.vector_norm(q)) + 1e-8
        if norm > constraint:
            q = q * (constraint / norm)
    eye = torch.eye(q.shape[-1], dtype=dtype)
    rotation: torch.Tensor = (eye + q) @ torch.linalg.inv(eye - q)
    return rotation


def scalar_alpha(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> float:
    """The constraint α from the `alpha` tensor; missing (or meta, shape-only planning) reads as 0 =
    unconstrained."""
    alpha = tensors.get("alpha")
    if alpha is None:
        return 0.0
    if alpha.numel() != 1:
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: {key_of['alpha']} should be a scalar, has shape {tuple(alpha.shape)}",
        )
    value = 0.0 if alpha.device.type == "meta" else float(alpha.reshape(()).double())  # int/fp64 alphas too
    if value != value or value in (float("inf"), float("-inf")):
        raise PartRejected("non_finite", f"bad tensor: {key_of['alpha']} is not finite")
    return value


def row_scale(rescale: torch.Tensor | None, rows: int, key: str | None) -> torch.Tensor | None:
    """rescale / boft_s: one factor per output row, stored (rows, 1[, 1…]) or (1, rows); flattened to
    (rows,)."""
    if rescale is None:
        return None
    if rescale.numel() != rows or max(rescale.shape, default=0) != rows:
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: {key} {tuple(rescale.shape)} is not one factor per row of {rows}",
        )
    return rescale.reshape(rows)


def rescaled(delta: torch.Tensor, y: torch.Tensor, rescale: torch.Tensor | None, s: float) -> torch.Tensor:
    """rescale ⊙ (y + delta) − y, channels last; the rescale at strength s per RESCALE_FOLLOWS_STRENGTH."""
    if rescale is None:
        return delta
    r = rescale.to(y.device, y.dtype)
    if RESCALE_FOLLOWS_STRENGTH:
        r = 1 + s * (r - 1)
    return r * delta + (r - 1) * y
