"""Select modes at runtime: on layers both adapters touch, one adapter runs per step (the other is gated to
0).

The schedule (which layer flips from subject to style at which step) comes from `stack/select.py`; this module
measures the per-layer deltas it needs and flips gates on the live runtime paths."""

from __future__ import annotations

import torch

from ...errors import ArgumentError
from ...stack.select import SelectSchedule
from ..quantized.write import intended_delta
from ..runtime.path import RuntimePath


def layer_key(component: str, path: str) -> str:
    return f"{component}.{path}"


def shared_layers(paths: dict[str, RuntimePath], names: tuple[str, str]) -> dict[str, RuntimePath]:
    return {
        k: rp
        for k, rp in paths.items()
        if all(n in {pp.adapter.name for pp, _ in rp.contributions} for n in names)
    }


def _dense(rp: RuntimePath, name: str) -> tuple[torch.Tensor, int]:
    """One adapter's ΔW on a layer at its strength (fp32, rows x in·k), and its rank (0 when not low-rank)."""
    host_weight = rp.module.weight
    assert isinstance(host_weight, torch.Tensor)  # a runtime path's host has a weight (runtime_blocker)
    weight = host_weight.detach()
    mine = [c for c in rp.contributions if c.part.adapter.name == name]
    shape = (rp.out, *weight.shape[1:])
    base = weight if weight.is_floating_point() else None
    rank = max((getattr(pp.factors, "rank", 0) or 0 for pp, _ in mine), default=0)
    return intended_delta(mine, shape, base), rank


def build_schedule(
    mode: str, paths: dict[str, RuntimePath], names: tuple[str, str], total_steps: int, **kwargs: float
) -> SelectSchedule:
    deltas, ranks = {}, {}
    for key, rp in shared_layers(paths, names).items():
        (d0, r0), (d1, r1) = _dense(rp, names[0]), _dense(rp, names[1])
        deltas[key], ranks[key] = (d0, d1), (max(r0, 1), max(r1, 1))
    return SelectSchedule.from_deltas(
        mode, deltas, total_steps, ranks=ranks if mode == "klora" else None, **kwargs
    )


def choose(rp: RuntimePath, names: tuple[str, str], index: int) -> None:
    if index not in (0, 1):
        raise ArgumentError(f"layer choice must be 0 (subject) or 1 (style), got {index!r}")
    rp.gates[names[index]] = 1.0
    rp.gates[names[1 - index]] = 0.0
    rp.refresh_scales()
