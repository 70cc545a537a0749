"""Host copies of a unit's slot layout, packed in a few allocations ("runs") instead of one per tensor.

torch's pinned-memory allocator rounds every request up to a power of two and caches freed blocks: one
allocation per tensor pins ~1.55x a Flux block (measured layout: 648 MiB of weights -> 1.02 GiB pinned).
Consecutive tensors grouped so each run's size sits just under a power of two cost ~1.07-1.09x, and a block is
then copied in a handful of transfers instead of one per tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .planner import tensor_bytes, typed_view

MAX_RUN = 1 << 30  # no single pinned allocation above 1 GiB (a request of 1 GiB + 1 B would pin 2 GiB)


def pins(device: torch.device, storage: torch.device) -> bool:
    """Host copies are pinned when they feed a CUDA device from CPU storage (asynchronous copies need it)."""
    return device.type == "cuda" and storage.type == "cpu"


def empty_host_cache() -> None:
    """Give cached pinned blocks back to the OS (torch keeps freed pinned memory for reuse otherwise)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def host_buffer(nbytes: int, storage: torch.device, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=storage, pin_memory=pin)


def allocated(nbytes: int, pin: bool) -> int:
    """Bytes an allocation of `nbytes` really takes (pinned: rounded up to a power of two)."""
    return 1 << max(nbytes - 1, 0).bit_length() if pin else nbytes


def group_runs(spans: list[tuple[int, int]], pin: bool) -> list[tuple[int, int]]:
    """Split consecutive byte spans (start, end) of a layout into runs [(start, end)] that waste the fewest
    allocated bytes (exact dynamic program over cut points; a run never exceeds MAX_RUN unless one span
    does)."""
    n = len(spans)
    if not n:
        return []
    if not pin:
        return [(spans[0][0], spans[-1][1])]  # unpinned memory is not rounded: one allocation
    best: list[int | None] = [0] + [None] * n  # best[j]: least waste laying out spans[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j - 1, -1, -1):
            size = spans[j - 1][1] - spans[i][0]
            if size > MAX_RUN and i < j - 1:
                break
            waste = best[i]
            assert waste is not None  # set when j was i: every j tries i = j - 1 first
            cost = waste + allocated(size, pin) - size
            best_j = best[j]
            if best_j is None or cost < best_j:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j:
        i = cut[j]
        runs.append((spans[i][0], spans[j - 1][1]))
        j = i
    return runs[::-1]


@dataclass(eq=False)
class Run:
    """Bytes [start, end) of a unit's slot layout, held in one host allocation."""

    start: int
    end: int
    host: torch.Tensor  # uint8, end - start bytes

    def view(self, offset: int, like: torch.Tensor) -> torch.Tensor:
        """A tensor shaped like `like` at layout byte `offset` (inside this run)."""
        return typed_view(self.host, offset - self.start, like)


def pack(
    items: list[tuple[int, torch.Tensor]], storage: torch.device, pin: bool
) -> tuple[list[Run], list[torch.Tensor]]:
    """Copy tensors placed at layout `offset`s into packed runs; returns the runs and each tensor's host
    view."""
    spans = [(off, off + tensor_bytes(t)) for off, t in items]
    runs = [Run(a, b, host_buffer(b - a, storage, pin)) for a, b in group_runs(spans, pin)]
    views, k = [], 0
    for off, t in items:
        while off >= runs[k].end:
            k += 1
        v = runs[k].view(off, t)
        v.copy_(t)
        views.append(v)
    return runs, views
