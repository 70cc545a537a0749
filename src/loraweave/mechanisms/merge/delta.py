"""The ΔW a merge adds: Σ coeff·ΔW of a block of rows, from the contributions and strengths it was made at
(the same function writes a merge and undoes a compact record)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch

from ...arch.spec import Piece
from ...families.base import CastMemo
from ...families.contribution import add_contribution
from ...resolve.planner import PlannedPart
from .undo import DeltaFn, acc_dtype, bits, recorded_threads

FusedAdd = Callable[[torch.Tensor, int, int], bool]  # (rows, r0, r1) -> whether rows [r0, r1) were written

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


def fused_adder(terms: list[Term], rows: torch.Tensor) -> FusedAdd | None:
    """W[r0:r1] += ΔW in one pass with no ΔW buffer (family.fused_add: LoRA's addmm_), for blocks the one
    term covers whole, with the bits of rows_delta then one add; None where that cannot hold: not one term,
    a weight of another dtype than ΔW's (fp16/bf16 round the sum once from fp32), a W-reading family, or a
    BLAS that fuses the product into the add (its bits would differ from the recorded paths')."""
    if len(terms) != 1 or rows.device.type != "cpu" or rows.dtype != acc_dtype(rows.dtype):
        return None
    ((pp, piece, strength, scale),) = terms
    family = pp.family
    if family.fused_add is None or family.needs_base or not blas_rounds_product(rows.dtype):
        return None
    add, casts = family.fused_add, CastMemo()
    lo, hi = piece.dst_start, piece.dst_start + piece.length

    def fused(target: torch.Tensor, r0: int, r1: int) -> bool:
        if r0 < lo or r1 > hi:  # rows the term does not cover get W + 0 (-0.0 becomes +0.0): rows_delta's
            return False
        with casts:
            add(target[r0:r1], pp.factors, piece.src_start + r0 - lo, r1 - r0, strength * scale)
        return True

    return fused


@functools.cache
def blas_rounds_product(dtype: torch.dtype) -> bool:
    """Whether the BLAS's in-place addmm_ (beta 1) rounds alpha·(up @ down) before adding it, as addmm with
    beta 0 then an add does: checked once per process and dtype on the CPU, at one intra-op thread (a pass's
    count), on block shapes of a rank-16 and a rank-4 LoRA."""
    g = torch.Generator().manual_seed(39)
    same = True
    with recorded_threads(1):
        for rows, cols, rank in ((341, 3072, 16), (37, 200, 4)):
            w = torch.randn(rows, cols, generator=g, dtype=dtype)
            up = torch.randn(rows, rank, generator=g, dtype=dtype)
            down = torch.randn(rank, cols, generator=g, dtype=dtype)
            two = w + torch.addmm(torch.empty_like(w), up, down, beta=0, alpha=0.37)
            same &= torch.equal(bits(w.addmm_(up, down, alpha=0.37)), bits(two))
    return same
