"""A copier on a virtual clock: the handle's own copy/wait/done calls timed from modelled copy and compute
seconds instead of a device. Used to model a schedule (benchmarks/stream_model.py) and to test that prefetch
runs ahead (tests); nothing in the streaming path itself uses it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .report import ForwardStats
from .slots import Copier, Slot
from .store import Unit


class ClockCopier(Copier):
    """One copy engine and one compute stream on a virtual clock (seconds).

    A copy starts when the engine is free and compute has released the slot (CUDA's `freed` event) and takes
    `copy_seconds(unit)`; compute waits for it (`ready`). Whoever runs the model advances `now` by each
    block's compute time before the handle's post-hook (a forward hook registered with prepend=True)."""

    def __init__(self, device: torch.device, copy_seconds: Callable[[Unit], float]) -> None:
        super().__init__(device)
        self.asynchronous = True
        self.copy_seconds = copy_seconds
        self.engine = 0.0  # when the copy engine is next free
        self.now = 0.0  # the compute stream's clock
        self.stall = 0.0  # compute time spent waiting for copies
        self.busy = 0.0  # copy engine time spent copying

    def attach(self, slot: Slot) -> None:
        slot.ready_at = slot.freed_at = 0.0

    def fill(self, slot: Slot, unit: Unit, stats: ForwardStats) -> None:
        slot.views = unit.slot_views(slot.buf)
        for dst, src in unit.copy_pairs(slot.buf):
            dst.copy_(src)
        seconds = self.copy_seconds(unit)
        slot.ready_at = self.engine = max(self.engine, slot.freed_at) + seconds
        self.busy += seconds
        stats.bytes_copied += unit.slot_layout_bytes
        stats.copies += 1

    def wait(self, slot: Slot, stats: ForwardStats, waited_copy_s: float = 0.0) -> None:
        self.stall += max(0.0, slot.ready_at - self.now)
        self.now = max(self.now, slot.ready_at)

    def done(self, slot: Slot) -> None:
        slot.freed_at = self.now

    def advance(self, seconds: float) -> None:
        """A block computed for `seconds`."""
        self.now += seconds
