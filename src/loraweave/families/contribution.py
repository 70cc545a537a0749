"""One contribution's delta added into weight rows: the coefficient rule, shared by merge, the stack modes
(families/combined) and bake. Below both families and mechanisms: reads the part's `family` (a Family)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..arch.spec import Piece
from ..formats.adapter import Adapter, AdapterPart

if TYPE_CHECKING:
    from .base import Family


class Planned(Protocol):
    """What this module reads of a planned part (resolve.planner.PlannedPart, a layer above)."""

    @property
    def adapter(self) -> Adapter: ...
    @property
    def part(self) -> AdapterPart: ...
    @property
    def family(self) -> Family: ...
    @property
    def factors(self) -> Any: ...
    @property
    def strength(self) -> float: ...
    @property
    def scale(self) -> float: ...


def coefficient(pp: Planned) -> float:
    """coeff = strength · scale (γ from alpha/rank or metadata)."""
    return pp.strength * pp.scale


def add_contribution(
    target_rows: torch.Tensor,
    pp: Planned,
    piece: Piece,
    base: torch.Tensor | None,
    coeff: float | None = None,
    strength: float | None = None,
    scale: float | None = None,
) -> None:
    """target_rows += coeff·ΔW (rows of `piece`), coeff = strength·scale unless given.

    base: the ORIGINAL weight as (out, in·k), read (its piece rows, in target's dtype) by W-dependent
    families. strength/scale: the part's own unless given (an undo record recomputes ΔW at the strength it was
    merged at)."""
    family = pp.family
    strength = pp.strength if strength is None else strength
    scale = pp.scale if scale is None else scale
    coeff = strength * scale if coeff is None else coeff
    rows = None
    if family.needs_base:
        if base is None:
            from .base import PartRejected  # here: families.combined imports this module

            raise PartRejected("unsupported", f"unsupported: {pp.part.family} needs the layer's float weight")
        rows = base[piece.dst_start : piece.dst_start + piece.length].to(target_rows.dtype)
    family.add(target_rows, pp.factors, piece.src_start, piece.length, coeff, rows, strength, scale)


def bias_of(pp: Planned, piece: Piece, original: torch.Tensor | None = None) -> torch.Tensor | None:
    """The part's unscaled bias delta for `piece` (None if it has none); `original`: the layer's original
    bias."""
    base = None
    if pp.family.bias_needs_base and isinstance(original, torch.Tensor):
        rows = original.detach()[piece.dst_start : piece.dst_start + piece.length]
        base = rows.to(torch.promote_types(rows.dtype, torch.float32), copy=True)
    return pp.family.bias(pp.factors, piece.src_start, piece.length, base)
