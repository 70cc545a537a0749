"""Threads of the block-by-block passes over a weight (merge, undo, strength change) on the CPU.

Each pass runs block by block of rows (a few MiB each). With torch's intra-op threads every op of a block is
a parallel region of its own, and on a busy host each one waits in an OpenMP barrier for a descheduled thread
(a merge at 2 threads under load took up to 6x its one-thread time; issue 39). So the passes run their ops on
one intra-op thread, and where torch had more, one of the spare threads computes the next block's ΔW (into a
second buffer) while the caller writes this one: one hand-over per block, no barrier per op. ΔW's bits do not
depend on the thread count then: a record made at any count is recomputed exactly at any other."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

# (rows ΔW reads, r0, r1, out) -> ΔW of rows [r0, r1) (undo.DeltaFn)
DeltaFn = Callable[[torch.Tensor, int, int, "torch.Tensor | None"], torch.Tensor]
_SPARE: ContextVar[int] = ContextVar("loraweave_spare_threads", default=0)
MAX_AHEAD = 7  # blocks whose ΔW is computed ahead at most (a block buffer each)


def pass_threads(device: torch.device) -> int:
    """The intra-op threads a pass over a weight on `device` runs with: one on the CPU, torch's elsewhere."""
    return 1 if device.type == "cpu" else torch.get_num_threads()


@contextmanager
def recorded_threads(n: int) -> Iterator[None]:
    """Run torch with `n` intra-op threads (a record's count: ΔW is recomputed as it was made), restored on
    exit; the threads torch had beyond `n` are lent to `block_deltas` meanwhile."""
    before = torch.get_num_threads()
    token = _SPARE.set(max(0, before - n)) if n != before else None
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if token is not None:
            torch.set_num_threads(before)
            _SPARE.reset(token)


@contextmanager
def block_deltas(
    delta_fn: DeltaFn, base: torch.Tensor, spans: list[tuple[int, int]], buffers: tuple[torch.Tensor, ...]
) -> Iterator[Iterator[tuple[int, int, torch.Tensor]]]:
    """(r0, r1, ΔW of rows [r0, r1)) for each span in turn, ΔW written into buffers[0] (flat, a block's
    size); with k spare threads (recorded_threads) and two buffers or more, the next min(k, MAX_AHEAD) spans'
    ΔW are computed ahead, each on one thread into a buffer of a ring (made like the last where too few are
    given). The caller must be done with a ΔW before it asks for the next but one. On exit (an exception
    included) nothing is left running."""
    cols = base[0].numel() if base.shape[0] else 0
    depth = min(_SPARE.get(), MAX_AHEAD, len(spans) - 1) if base.device.type == "cpu" else 0
    if depth < 1 or len(buffers) < 2:
        yield ((r0, r1, delta_fn(base, r0, r1, buffers[0][: (r1 - r0) * cols])) for r0, r1 in spans)
        return
    # a ring of depth + 1 buffers: span i + depth is submitted once the caller is done with span i - 1's
    ring = (*buffers, *(torch.empty_like(buffers[-1]) for _ in range(depth + 1 - len(buffers))))

    def compute(i: int) -> torch.Tensor:
        r0, r1 = spans[i]
        return delta_fn(base, r0, r1, ring[i % (depth + 1)][: (r1 - r0) * cols])

    with ThreadPoolExecutor(depth, thread_name_prefix="loraweave-delta") as pool:
        futures = {i: pool.submit(compute, i) for i in range(depth)}

        def ahead() -> Iterator[tuple[int, int, torch.Tensor]]:
            for i, (r0, r1) in enumerate(spans):
                if i + depth < len(spans):
                    futures[i + depth] = pool.submit(compute, i + depth)
                delta = futures.pop(i).result()
                yield r0, r1, delta

        try:
            yield ahead()
        finally:
            for future in futures.values():
                future.cancel()  # the pool's exit waits for those already running
