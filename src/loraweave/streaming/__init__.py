"""Layer streaming under a device memory budget: resident prefix, streamed blocks, adapters included.

`stream(model, budget="auto" | bytes, device=..., storage="cpu") -> StreamHandle`."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..arguments import byte_size
from ..errors import ArgumentError
from .handle import STREAMED_ATTR, StreamHandle
from .ledger import Ledger
from .planner import StreamPlan, check_placement, find_blocks, plan_residency
from .report import ForwardStats, StreamReport

log = logging.getLogger("loraweave")
# Kept free on a CUDA device for activations, workspaces and the allocator. sd.cpp keeps 512 MiB; a Flux 1024²
# CFG forward peaks at ~0.9 GiB of activations with flash attention (meta-device trace), so 512 MiB would OOM.
AUTO_MARGIN = 2 * 2**30

__all__ = [
    "STREAMED_ATTR",
    "ForwardStats",
    "Ledger",
    "StreamHandle",
    "StreamPlan",
    "StreamReport",
    "find_blocks",
    "plan_residency",
    "stream",
]


def _indexed(dev: torch.device) -> torch.device:
    """`cuda` without an index as the current CUDA device (torch.device("cuda") != torch.device("cuda:0"))."""
    return (
        torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev
    )


def stream(
    model: torch.nn.Module,
    budget: str | int = "auto",
    device: str | torch.device | None = None,
    storage: str | torch.device = "cpu",
    margin: int | None = None,
    blocks: list[str] | None = None,
    free_bytes: Callable[[], int] | None = None,
    trace: bool = False,
    placement: str = "prefix",
) -> StreamHandle:
    """Run `model` (inference) with its repeated blocks streamed from `storage` through device slots.

    budget: "auto" (free device memory at each forward, minus `margin`) or bytes (an int, or a size string
      such as "24GB" = 24·10⁹ or "20GiB" = 20·2³⁰) the streamer may hold on the
      device (clamped at each forward to what is free then). The plan keeps the rest of the model, adapter
      factors and a resident prefix of blocks on the device, and streams the other blocks through two slots
      (the block computing and the next one, prefetched on a side stream on CUDA).
    device: compute device (default: CUDA when available, else CPU; CPU = simulation, storage and compute
    alike). margin: bytes of the budget left free for activations; default 2 GiB on CUDA (raise it for large
      video or high-resolution activations), 0 on CPU.
    blocks: module paths of the blocks to stream (default: the children of the outermost ModuleLists).
    free_bytes: how many device bytes are free now (default: asked from CUDA; tests simulate a device with
    it). trace: keep every ledger event in `handle.report.trace` (tests assert each against the budget).
    placement: "prefix" keeps the first blocks resident (sd.cpp's rule); "spread" spreads the streamed blocks
      among the resident ones, so each copy can hide behind several blocks' compute (for when a block copies
      slower than it computes). The same number of bytes stays resident either way, give or take the slot
      size.

    Runtime adapters (`loraweave.apply(model, ..., mode="runtime" | "auto")`) may be applied before or after.
    Factors of layers inside a block travel with it (part of its slot copy, bound to the layer while it
    computes); the others (the rest of the model, quantized layers) stay on the device; all are counted in the
    plan. Strength changes and adapter switches between forwards are picked up: slot contents are versioned
    (block, plan, weight versions, adapter set), so a prefetched copy made before the change is never used.
    Every weight-holding layer is marked `_loraweave_streamed`, so merging (which would write a copy) is
    refused and `auto` picks runtime.

    Inference only (forwards under torch.no_grad()); do not move the model (`.to()`) while it streams: close()
    first (a replaced tensor is detected and refused)."""
    dev = _indexed(
        _device(device, "device")
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    store = _indexed(_device(storage, "storage"))
    requested = None if budget == "auto" else byte_size(budget, "budget")  # bytes, or "24GB", "512MiB"
    check_placement(placement)  # before anything is copied or pinned
    if margin is None:
        margin = AUTO_MARGIN if dev.type == "cuda" else 0
    margin = byte_size(margin, "margin", allow_zero=True)
    if any(getattr(m, STREAMED_ATTR, False) for m in model.modules()):
        raise ArgumentError("model is already streamed; close() its StreamHandle first")
    if blocks is None:
        found = find_blocks(model)
    else:
        found = [(name, _block(model, name)) for name in blocks]
        nested = [(a, b) for a in blocks for b in blocks if a != b and b.startswith(a + ".")]
        if nested:
            raise ArgumentError(
                f"blocks must not contain each other: {nested[0][1]!r} is inside {nested[0][0]!r}"
            )
    if not found:
        raise ArgumentError(f"no repeated blocks found in {type(model).__name__}; pass blocks=[module paths]")
    handle = StreamHandle(
        model, found, requested, dev, store, margin, free_bytes, trace=trace, placement=placement
    )
    handle.report.log()
    return handle


def _device(value: str | torch.device, what: str) -> torch.device:
    try:
        return torch.device(value)
    except (RuntimeError, TypeError) as exc:  # torch's own message lists the device types
        raise ArgumentError(f"{what} must be a torch device or its name, got {value!r} ({exc})") from None


def _block(model: torch.nn.Module, name: str) -> torch.nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ArgumentError(f"blocks: {type(model).__name__} has no module {name!r}") from None
