"""The ΔW a merge adds: Σ coeff·ΔW of a block of rows, from the contributions and strengths it was made at
(the same function writes a merge and undoes a compact record)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...arch.spec import Piece
from ...families.base import CastMemo
from ...families.contribution import add_contribution
from ...resolve.planner import PlannedPart
from .undo import DeltaFn, acc_dtype

Term = tuple[PlannedPart, Piece, float, float]  # part, piece, strength, scale


def delta_fn(terms: list[Term]) -> DeltaFn:
    """ΔW of rows [r0, r1); the factors are cast once for all blocks of this layer (the casts live as long
    as the function: one write or undo), not once per block."""
    casts = CastMemo()

    def delta(base: torch.Tensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
        with casts:
            return rows_delta(base, terms, r0, r1, out)

    return delta


def rows_delta(
    base: torch.Tensor,
    terms: list[Term],
    r0: int,
    r1: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ coeff·ΔW of rows [r0, r1) (fp32; fp64 weights: fp64), in `out` (a flat scratch buffer) when
    given; `base` (out, in·k) is what W-dependent families read. Contributions are independent and summed;
    the same call undoes a compact record."""
    shape = (r1 - r0, *base.shape[1:])
    if out is None:
        delta = torch.empty(shape, dtype=acc_dtype(base.dtype), device=base.device)
    else:
        delta = out.view(shape)
    filled = False  # the first term covering the whole block writes it (no zero pass, no read of zeros)
    for pp, piece, strength, scale in terms:
        lo, hi = max(r0, piece.dst_start), min(r1, piece.dst_start + piece.length)
        if lo >= hi:
            continue
        part = (
            piece
            if (lo, hi) == (piece.dst_start, piece.dst_start + piece.length)
            else replace(
                piece, src_start=piece.src_start + lo - piece.dst_start, dst_start=lo, length=hi - lo
            )
        )
        family = pp.family
        if not filled and (lo, hi) == (r0, r1) and family.set_delta is not None and not family.needs_base:
            family.set_delta(delta, pp.factors, part.src_start, part.length, strength * scale)
        else:
            if not filled:
                delta.zero_()
            add_contribution(delta[lo - r0 : hi - r0], pp, part, base, strength=strength, scale=scale)
        filled = True
    if not filled:
        delta.zero_()
    return delta
