"""The module ComfyUI's model management loads, counts and moves for the runtime paths: their adapter
tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..families.base import CastCache
from ..mechanisms.runtime.path import RuntimePath


class FactorHolder(torch.nn.Module):
    """Every tensor the paths read (the sources of RuntimePath.caches: low-rank pairs and their scales, dense
    diffs, bias deltas, and what each structured term declares: LoKr/LoHa/GLoRA factors, cached dense ΔW, OFT
    and BOFT rotations, DoRA magnitudes, inner factors and gains, IA3 vectors) as parameters of one module, so
    a ModelPatcher over it is counted by model management (`model_size`) and moved by it. Each parameter
    starts as a view of its tensor's storage; the caches are pointed at the parameters now and again after
    every move (`_apply`, what `.to()` runs, whether torch moved a parameter in place or replaced it, as for
    `meta`), and when the state is injected (`repoint`), so the paths read whatever the holder holds. A tensor
    shared by two paths is one parameter."""

    def __init__(self, paths: Sequence[RuntimePath]) -> None:
        super().__init__()
        index: dict[int, int] = {}
        self.slots: list[tuple[CastCache, list[int]]] = []  # each cache and the parameters it reads
        for cache in {id(c): c for rp in paths for c in rp.caches()}.values():
            for t in cache.tensors:
                if id(t) not in index:
                    index[id(t)] = len(index)
                    self.register_parameter(f"t{index[id(t)]}", torch.nn.Parameter(t, requires_grad=False))
            self.slots.append((cache, [index[id(t)] for t in cache.tensors]))
        self.repoint()

    def repoint(self) -> None:
        """Point every cache at this holder's current parameters (their casts are dropped)."""
        params = list(self.parameters())
        for cache, slots in self.slots:
            cache.repoint(tuple(params[i] for i in slots))

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.repoint()
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("FactorHolder only holds factors")
