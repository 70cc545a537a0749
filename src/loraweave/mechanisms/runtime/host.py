"""What a runtime path is built on and from: the host layer (runtime_blocker, runtime_host, its convolution
and kernel dims) and the records its install sorts each adapter term into (RankSpan, CachedRows, FnRows)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from ...families.base import CastCache, RuntimeTerm
from ...quant import QuantBackend, backend_for
from ...resolve.planner import PlannedPart

ConvFn = Callable[..., torch.Tensor]
_CONVS: dict[type[torch.nn.Module], ConvFn] = {
    torch.nn.Conv1d: F.conv1d,
    torch.nn.Conv2d: F.conv2d,
    torch.nn.Conv3d: F.conv3d,
}
# Norm layers carry only structured terms (e.g. LyCORIS `w_norm`): channels on the last axis or on axis 1.
_NORMS_CHANNELS_LAST = (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", torch.nn.LayerNorm))
NORMS_CHANNELS_FIRST = (torch.nn.GroupNorm,)


def runtime_blocker(module: torch.nn.Module) -> str | None:
    """Why this module cannot carry a runtime path, or None."""
    if type(module) in _CONVS or any(isinstance(module, c) for c in _CONVS):
        if module.groups != 1 or module.padding_mode != "zeros":
            return "runtime path supports only plain convolutions (groups=1, zero padding)"
        return None
    if isinstance(getattr(module, "in_features", None), int) and isinstance(
        getattr(module, "out_features", None), int
    ):
        return None
    if isinstance(module, _NORMS_CHANNELS_LAST + NORMS_CHANNELS_FIRST) or type(module).__name__ == "RMSNorm":
        return None  # the last: diffusers' own RMSNorm (channels last)
    return f"no runtime path for {type(module).__name__} (only Linear-like, Conv and norm layers)"


class DequantizedView:
    """Host seen by families that read W (DoRA, GLoRA, ...) on a quantized layer: the backend's dequantized
    weight, formed on each access (never the packed storage, never a resident float copy)."""

    def __init__(self, module: torch.nn.Module, backend: QuantBackend) -> None:
        self._module, self._backend = module, backend

    @property
    def weight(self) -> torch.Tensor:
        return self._backend.dequantize(self._module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def runtime_host(module: torch.nn.Module) -> torch.nn.Module | DequantizedView:
    """What families that read the host module see: the module, or a dequantized view of a quantized one."""
    backend = backend_for(module)
    if backend is None or backend.unavailable() or not backend.capabilities(module).dequantize:
        return module
    return DequantizedView(module, backend)


def host_bias(module: torch.nn.Module) -> torch.Tensor | None:
    """The bias the layer adds, in output order (a quantized layer may store it packed)."""
    backend = backend_for(module)
    if backend is not None:
        return backend.logical_bias(module)
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def kernel_dims(module: torch.nn.Module) -> tuple[int, ...]:
    """(in, *k) of a conv weight; packed quantized storage has its own shape, so ask the backend first."""
    backend = backend_for(module)
    shape = backend.logical_shape(module) if backend is not None else None
    if shape:
        return tuple(shape[1:])
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # a conv host (runtime_blocker)
    return tuple(weight.shape[1:])


def conv_fn(module: torch.nn.Module) -> ConvFn | None:
    return next((fn for cls, fn in _CONVS.items() if isinstance(module, cls)), None)


@dataclass(frozen=True, slots=True)
class RankSpan:
    """One part's ranks in the layer's rank-concatenated pair, in pair order."""

    part: PlannedPart
    rank: int


@dataclass(frozen=True, slots=True)
class CachedRows:
    """A dense ΔW or a bias delta on output rows [dst, dst+rows), read through a cache a host may re-point."""

    part: PlannedPart
    dst: int
    rows: int
    cache: CastCache


@dataclass(frozen=True, slots=True)
class FnRows:
    """A structured term (LoKr, LoHa, ...; OFT, DoRA, IA3, ... when it reads the base output) on output rows
    [dst, dst+rows); `linear`: linear in strength, so the path scales its result by strength·scale."""

    part: PlannedPart
    dst: int
    rows: int
    fn: Callable[..., torch.Tensor]
    linear: bool


_Record = TypeVar("_Record", RankSpan, CachedRows, FnRows)


def rebound(records: list[_Record], mapping: dict[int, PlannedPart]) -> list[_Record]:
    """The records pointed at the planned parts `mapping` gives for their parts' ids (others kept)."""
    return [replace(r, part=mapping.get(id(r.part), r.part)) for r in records]


# each low-rank pair before concatenation: its down (r, in, *k) and the row chunks sharing it
Pair = tuple[torch.Tensor, list[RuntimeTerm]]
