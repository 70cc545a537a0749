"""What every family module provides: load + validate factors, add its delta, give its runtime terms.

A family module defines FAMILY, load, check_target, add_delta, bias_delta and runtime_term, and optionally:
- USES_ALPHA_SCALE = False: the planner does not turn alpha into γ = alpha/rank (scale stays 1); the raw
  `alpha` tensor is handed to `load` (OFT reads it as its constraint).
- NEEDS_BASE = True: the delta depends on the original weight W (OFT, BOFT, DoRA, IA3, GLoRA).
  `add_delta(..., base=W_rows)` receives the original rows in fp32, and the runtime term's
  `fn(x, conv, base_out)` receives the layer's output without bias, before any adapter was added.
  add_delta also receives `strength=` and `scale=` (coeff = strength·scale) for families not linear in them.
- runtime_term(f, src, dst, length, module=...) receives the host module when it accepts that keyword.
- check_piece(f, src, length) -> reason | None: whether rows [src, src+length) of the delta can land on their
  own (a fused key split over modules); the planner asks before anything is touched.
Every family contributes ΔW_i computed from the ORIGINAL weight; contributions on one layer are summed
(the rule a1111/LyCORIS loaders use when several networks touch one layer), so order never matters."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


class PartRejected(Exception):
    """A part cannot be applied; the message is the reason written into the report."""


@dataclass
class RuntimeTerm:
    """One contribution to a layer's runtime path: y[rows] += coeff · (up_rows @ down(x) | dense(x) | fn(x)).

    Exactly one of (down, up), dense or fn is set, plus an optional bias. `fn(x, conv)` returns the unscaled
    delta output for input x, rows [dst_start, dst_start+length); `conv` holds the layer's conv function and
    its stride/padding/dilation (None for Linear). fn casts its own tensors to x's device and dtype."""

    down: torch.Tensor | None  # (r, in, *k): LoRA down with any Tucker core folded in
    up: torch.Tensor | None  # (length, r)
    dense: torch.Tensor | None  # (length, in, *k) for full diffs
    bias: torch.Tensor | None  # (length,)
    dst_start: int
    length: int
    fn: Callable[..., torch.Tensor] | None = None
    cost: str = ""  # what the runtime form costs, for the report ("dense ΔW cached", ...)
    needs_base: bool = False  # fn takes a third argument: the base output without bias
    # False: fn(x, conv, base_out, strength, scale) applies the live strength itself (OFT, DoRA) and the
    # runtime does not multiply its result by strength·scale.
    linear_in_strength: bool = True


@dataclass(frozen=True)
class ConvSpec:
    """How the host layer convolves: the function (F.conv1d/2d/3d) and its keyword arguments."""

    fn: Callable
    kwargs: dict


class CastCache:
    """Tensors cast once per (device, dtype) for the runtime path; strength changes never rebuild them."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors
        self._key = None
        self._cast: tuple[torch.Tensor, ...] = ()

    def get(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.to(like.device, like.dtype)

    def put(self, device: torch.device, dtype: torch.dtype, cast: tuple[torch.Tensor, ...]) -> None:
        """Use `cast` (tensors someone else owns, e.g. a streaming slot's views) as the (device, dtype) copy."""
        self._key, self._cast = (device, dtype), tuple(cast)

    def clear(self) -> None:
        self._key, self._cast = None, ()

    def to(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if (device, dtype) != self._key:
            self._cast = tuple(t.to(device, dtype, non_blocking=_staged(t, device)) for t in self.tensors)
            self._key = (device, dtype)
        return self._cast

    def refresh(self) -> None:
        """The source tensors changed in place (a strength change): write them into the existing cast, ordered
        on the current stream after the kernels still reading it, without allocating or synchronizing."""
        if not self._cast:
            return  # nothing cast yet: the next forward casts the current values
        for cast, t in zip(self._cast, self.tensors, strict=True):
            if cast is not t:
                cast.copy_(t, non_blocking=_staged(t, cast.device))


def _staged(t: torch.Tensor, device: torch.device) -> bool:
    """A copy from pageable host memory to an accelerator can be issued without waiting: the driver stages the
    source at once, so it may change right after (a pinned source is read later: wait; a copy towards the host
    must block, its values are read right after)."""
    return device.type not in ("cpu", "meta") and t.device.type == "cpu" and not t.is_pinned()


@functools.cache
def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether a family function accepts an optional keyword (checked once per function, not per layer)."""
    return name in inspect.signature(fn).parameters


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
