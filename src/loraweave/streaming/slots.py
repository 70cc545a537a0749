"""Versioned slots: device buffers a streamed block is copied into, with the events that order copy and
compute."""

from __future__ import annotations

import time

import torch

from .report import ForwardStats
from .store import Unit


class Slot:
    """A flat device buffer holding one block's tensors as views.

    `tag` says which block, at which version, under which plan epoch the contents are; a slot whose tag no
    longer matches (weights written, plan changed) is never used: it is copied again."""

    # virtual-clock times (seconds), kept only by ClockCopier (clock.py) in place of the CUDA events
    ready_at: float
    freed_at: float

    def __init__(self, nbytes: int, device: torch.device, copier: Copier) -> None:
        self.buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
        self.index: int | None = None  # block held
        self.tag: tuple | None = None
        self.views: list[torch.Tensor | None] | None = None
        self.busy = False  # a block is computing from it
        self.prefetched = False  # filled ahead of use (counted when it is used)
        self.copy_s = 0.0  # wall time of its last copy (CPU: all of it is compute waiting)
        # ready: copy finished (compute waits on it); freed: compute finished with it (the next copy waits on
        # it)
        self.ready = self.freed = None
        self.freed_recorded = False
        copier.attach(self)


class Copier:
    """Copies a block into a slot: on CUDA on a side stream, ordered by the slot's events; on CPU
    synchronously.

    Timings come from CUDA events (resolved lazily, never forcing a sync mid-forward) or from the wall
    clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.asynchronous = self.cuda  # copies overlap compute (the report's overlap is meaningful)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._pending_copy: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending_stall: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def attach(self, slot: Slot) -> None:
        """Give a new slot its ordering events."""
        if self.cuda:
            slot.ready, slot.freed = torch.cuda.Event(), torch.cuda.Event()
            # The buffer may reuse memory compute kernels still read: the first copy waits for them.
            slot.freed.record(torch.cuda.current_stream(self.device))
            slot.freed_recorded = True

    def fill(self, slot: Slot, unit: Unit, stats: ForwardStats) -> None:
        slot.views = unit.slot_views(slot.buf)
        if self.cuda:
            with torch.cuda.stream(self.stream):
                if (
                    slot.freed_recorded
                ):  # the block computing from this slot must be done before we overwrite it
                    self.stream.wait_event(slot.freed)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                for dst, src in unit.copy_pairs(slot.buf):
                    dst.copy_(src, non_blocking=True)
                end.record(self.stream)
                slot.ready.record(self.stream)
            self._pending_copy.append((start, end))
        else:
            t0 = time.perf_counter()
            for dst, src in unit.copy_pairs(slot.buf):
                dst.copy_(src)
            stats.copy_seconds += time.perf_counter() - t0
        stats.bytes_copied += unit.slot_layout_bytes
        stats.copies += 1

    def wait(self, slot: Slot, stats: ForwardStats, waited_copy_s: float = 0.0) -> None:
        """Make compute wait for the slot's copy (CUDA); on CPU the copy already finished and was all
        stall."""
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(compute)
            compute.wait_event(slot.ready)
            after.record(compute)
            self._pending_stall.append((before, after))
        else:
            stats.stall_seconds += waited_copy_s

    def done(self, slot: Slot) -> None:
        """Compute finished with the slot: later copies into it wait for this point of the compute stream."""
        if self.cuda:
            slot.freed.record(torch.cuda.current_stream(self.device))
            slot.freed_recorded = True

    def resolve(self, stats: ForwardStats, block: bool = False) -> None:
        """Fold finished CUDA timings into `stats` (all of them, synchronizing, when `block`)."""
        if not self.cuda:
            return
        for pending, attr in ((self._pending_copy, "copy_seconds"), (self._pending_stall, "stall_seconds")):
            keep = []
            for start, end in pending:
                if block:
                    end.synchronize()
                if end.query():
                    setattr(stats, attr, getattr(stats, attr) + start.elapsed_time(end) / 1e3)
                else:
                    keep.append((start, end))
            pending[:] = keep

    def drain(self) -> None:
        """Every issued copy finished (before slot buffers are dropped)."""
        if self.cuda:
            self.stream.synchronize()
