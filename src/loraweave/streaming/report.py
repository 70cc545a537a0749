"""What streaming did: the plan (resident/streamed blocks, bytes), bytes copied per forward, copy/compute
overlap."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .planner import StreamPlan

log = logging.getLogger("loraweave")


@dataclass
class ForwardStats:
    bytes_copied: int = 0
    copies: int = 0  # block copies into a slot (prefetched or on demand)
    prefetched: int = 0  # streamed blocks whose copy was issued one block ahead (before they were needed)
    on_demand: int = (
        0  # streamed blocks copied only when called (first block, mispredicted order, stale slot)
    )
    kept: int = 0  # streamed blocks found still valid in their slot from earlier (no copy at all)
    stale: int = 0  # slot copies thrown away because the block changed since they were made (versioned slots)
    copy_seconds: float = 0.0
    stall_seconds: float = 0.0  # compute waiting for a copy

    def add(self, other: ForwardStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class StreamReport:
    device: str
    storage: str
    plan: StreamPlan
    forwards: int = 0
    last: ForwardStats = field(default_factory=ForwardStats)
    total: ForwardStats = field(default_factory=ForwardStats)
    peak_bytes: int = 0  # most device bytes the ledger ever held
    replans: int = 0
    releases: int = 0
    trace: list[tuple[str, int]] | None = (
        None  # ledger events when tracing (tests: asserted against the budget)
    )
    asynchronous: bool = False  # copies run beside compute (CUDA side stream)

    @property
    def blocks(self) -> list[dict]:
        p = self.plan
        return [
            {"name": n, "bytes": b, "resident": r}
            for n, b, r in zip(p.block_names, p.block_bytes, p.resident, strict=True)
        ]

    @property
    def copy_bandwidth(self) -> float | None:
        """Achieved host-to-device bytes/s over all copies so far (None before any timed copy)."""
        t = self.total
        return t.bytes_copied / t.copy_seconds if t.copy_seconds > 0 else None

    @property
    def overlap(self) -> float | None:
        """Fraction of copy time hidden behind compute: 1 - stall/copy (0 on CPU, where copies are
        synchronous)."""
        t = self.total
        if t.copy_seconds <= 0:
            return None
        if not self.asynchronous:
            return 0.0  # synchronous copies: nothing overlaps (an unused wrap-around prefetch is not overlap)
        return max(0.0, min(1.0, 1.0 - t.stall_seconds / t.copy_seconds))

    def summary(self) -> str:
        p = self.plan
        bw = self.copy_bandwidth
        ov = self.overlap
        return (
            f"stream device={self.device} storage={self.storage} placement={p.placement} budget={p.budget} "
            f"margin={p.margin} "
            f"resident={sum(p.resident)} streamed={len(p.resident) - sum(p.resident)} "
            f"device_bytes={p.device_bytes} peak_bytes={self.peak_bytes} adapter_bytes={p.extra_bytes} "
            f"forwards={self.forwards} bytes_per_forward={self.last.bytes_copied} "
            f"prefetched={self.last.prefetched} on_demand={self.last.on_demand} kept={self.last.kept} "
            f"copy_GBps={'n/a' if bw is None else f'{bw / 1e9:.2f}'} "
            f"overlap={'n/a' if ov is None else f'{ov:.2f}'} replans={self.replans}"
        )

    def log(self) -> None:
        log.info("loraweave %s", self.summary())
