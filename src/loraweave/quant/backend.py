"""What a quantized-weight backend can do: one small module per backend declares it.

A backend module defines one `QuantBackend` subclass instance named BACKEND. The mechanisms in
`mechanisms/quantized/write.py` ask it, never the layer's class directly, so a new backend is one new file."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

Restore = Callable[[], None]  # undoes a write bit-exactly (original tensors / class put back)
_SPARES: ContextVar[dict[int, object] | None] = ContextVar("loraweave_spare_branches", default=None)


@contextmanager
def reused_branches() -> Iterator[None]:
    """Within (a switch that undoes every write, then installs the new set): an undone factor write may leave
    its joined side-channel tensors for the next write on the same layer, which then rewrites only the
    appended part in place; whatever is left is released on exit (nothing outlives the switch)."""
    token = _SPARES.set({})
    try:
        yield
    finally:
        _SPARES.reset(token)


def spare_branches() -> dict[int, object] | None:
    """The pool of `reused_branches` (id(module) -> a backend's own record), or None outside it."""
    return _SPARES.get()


class FactorSlot:
    """The undo of an `append_factors` that can also rewrite its appended up factors in place: a strength
    change then costs one (out, r) write instead of a new concatenation."""

    def __call__(self) -> None:
        raise NotImplementedError

    def rescale(self, up: torch.Tensor) -> bool:
        """Store `up` (out, r), already scaled, as the appended up factors (the down factors are unchanged);
        False when the appended tensors are no longer the layer's (the caller rewrites from the originals)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Capabilities:
    dequantize: bool
    requantize: bool
    factor_channel: bool  # a low-rank side branch (svd_up/svd_down) the adapter's factors can ride
    reason: str = ""  # what is missing on this machine / for this layer, reported as is


class QuantBackend:
    name: str = "?"

    def unavailable(self) -> str | None:
        """Why this backend cannot run on this machine (package missing, no CPU kernels), or None."""
        return None

    def owns(self, module: torch.nn.Module) -> bool:
        """Whether `module` is a quantized layer of this backend (cheap: class / attribute checks only)."""
        raise NotImplementedError

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        raise NotImplementedError

    def bits(self, module: torch.nn.Module) -> int:
        raise NotImplementedError

    def logical_shape(self, module: torch.nn.Module) -> tuple[int, ...] | None:
        """The weight's logical shape (out, in, *k) when the storage is packed; None: ask the module."""
        return None

    def malformed(self, module: torch.nn.Module) -> str | None:
        """Why the layer's stored tensors contradict each other (a hostile or corrupt checkpoint), or None."""
        return None

    def logical_bias(self, module: torch.nn.Module) -> torch.Tensor | None:
        """The bias the layer adds, in output order (a backend that packs it unpacks it here)."""
        bias = getattr(module, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def has_checkpoint_svd(self, module: torch.nn.Module) -> bool:
        """Whether the layer's side channel already carries a low-rank part from the checkpoint."""
        return False

    def grid_step(self, module: torch.nn.Module) -> float:
        """Mean quantization step of the layer's grid (codebooks: mean gap between adjacent levels)."""
        raise NotImplementedError

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        """The float32 weight the layer computes with, logical shape (out, in, *k)."""
        raise NotImplementedError

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        """Store `weight` quantized with the layer's own config; returns the bit-exact undo."""
        raise NotImplementedError

    def append_factors(self, module: torch.nn.Module, down: torch.Tensor, up: torch.Tensor) -> Restore:
        """Add up @ down (already scaled) to the layer's low-rank side channel; returns the bit-exact undo
        (a `FactorSlot` where the backend can rescale the appended factors in place)."""
        raise NotImplementedError


Probe = Callable[[], dict[str, "str | None"]]  # {"package": why or None, kind: why or None}


def probe_once(run: Probe) -> Probe:
    """A backend's probe (quantize and run a tiny layer per kind), run once per process on a forked RNG."""

    @functools.cache
    def probe() -> dict[str, str | None]:
        with torch.random.fork_rng(
            devices=[]
        ):  # layer constructors draw from the global RNG: not the caller's
            return run()

    return probe


class KindProbedBackend(QuantBackend):
    """A backend whose quant kinds are probed on this machine; subclasses set `probe = staticmethod(...)`."""

    probe: Probe

    def unavailable(self) -> str | None:
        found = self.probe()
        if found["package"]:
            return found["package"]
        kinds = [why for kind, why in found.items() if kind != "package"]
        reasons = [why for why in kinds if why]
        # unusable only when every kind is
        return "; ".join(reasons) if kinds and len(reasons) == len(kinds) else None

    def kind_unavailable(self, kind: str) -> str | None:
        """Why layers of quant `kind` cannot run here, or None."""
        found = self.probe()
        return found["package"] or found.get(kind, f"unknown {self.name} kind {kind!r}")
