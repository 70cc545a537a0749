"""Stack modes on layers that several adapters touch: their contributions become one `combined` part.

`sum` keeps contributions as they are (exact; the runtime path concatenates their ranks). The other dense
modes replace each shared layer's contributions with one combined part (families/combined.py); layers one
adapter touches are left alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..arch.spec import Piece, module_shape
from ..families import combined
from ..families.combined import CombinedFactors
from ..formats.adapter import AdapterPart
from ..modes import StackMode
from ..stack.combine import DENSE_MODES, SELECT_MODES, validate_stack
from .planner import PlannedPart


class Contribution(NamedTuple):
    """One planned part's piece landing on one layer (unpacks as `pp, piece`)."""

    part: PlannedPart
    piece: Piece


def stack_key(component: str, path: str, names: list[str]) -> str:
    """What DARE masks derive from: the layer and the adapters on it (mode and density are added by the
    masks)."""
    return f"{component}.{path}|" + "|".join(names)


def adapter_names(contributions: list[Contribution]) -> set[str]:
    """Adapters behind contributions, looking through combined parts."""
    names: set[str] = set()
    for pp, _ in contributions:
        sources = pp.factors.sources if isinstance(pp.factors, CombinedFactors) else None
        names |= {s.adapter.name for s, _ in sources} if sources else {pp.adapter.name}
    return names


def combine_groups(
    groups: dict[tuple[str, str], list[Contribution]],
    modules: Mapping[str, torch.nn.Module],
    mode: StackMode,
    density: float | None,
) -> dict[tuple[str, str], list[Contribution]]:
    """Groups with each shared layer's contributions replaced by one combined part (mode != "sum")."""
    validate_stack(mode, density)
    if mode == "sum" or mode in SELECT_MODES:  # select modes keep both adapters; gates pick one per step
        return groups
    assert mode in DENSE_MODES
    out: dict[tuple[str, str], list[Contribution]] = {}
    for (comp, path), contribs in groups.items():
        names = sorted({pp.adapter.name for pp, _ in contribs})
        if len(names) < 2:
            out[(comp, path)] = contribs
            continue
        shape = module_shape(modules[comp].get_submodule(path))
        assert shape is not None  # parts were planned onto this layer: it has a weight
        factors = CombinedFactors(list(contribs), mode, density, stack_key(comp, path, names), tuple(shape))
        part = AdapterPart(f"stack:{comp}.{path}", comp, path, "stack", True, "combined")
        pp = PlannedPart(
            contribs[0][0].adapter,
            part,
            combined.SPEC,
            comp,
            (Piece(path, 0, 0, shape[0], True),),
            factors,
            1.0,
            "none:combined",
            1.0,
            [f"stack={mode} of {', '.join(names)}"],
        )
        out[(comp, path)] = [Contribution(pp, pp.pieces[0])]
    return out
