"""Threads of the block-by-block passes over a weight (merge, undo, strength change) on the CPU.

Each pass runs block by block of rows (a few MiB each). With torch's intra-op threads every op of a block is
a parallel region of its own, and on a busy host each one waits in an OpenMP barrier for a descheduled thread
(a merge at 2 threads under load took up to 6x its one-thread time; issue 39). So the passes run their ops on
one intra-op thread, and where torch had more, the spare threads take whole spans: the next blocks' ΔW
(`block_deltas`) or whole blocks (blocks.py, direct.py, the record's rebuild: `each_span`), claimed span by
span (`Claims`), so a descheduled thread holds up one span at most. Every span is computed on one thread at
one intra-op thread: ΔW's bits do not depend on the thread count, and a record made at any count is
recomputed exactly at any other."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
B = TypeVar("B")
# (rows ΔW reads, r0, r1, out) -> ΔW of rows [r0, r1) (undo.DeltaFn)
DeltaFn = Callable[[torch.Tensor, int, int, "torch.Tensor | None"], torch.Tensor]
_SPARE: ContextVar[int] = ContextVar("loraweave_spare_threads", default=0)
# within shared_helpers: [(pool, its thread count)], the one pool the passes lend their helpers from
HelperPools = list[tuple[ThreadPoolExecutor, int]]
_HELPERS: ContextVar[HelperPools | None] = ContextVar("loraweave_helpers", default=None)
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
    ΔW are computed ahead into a ring of buffers (made like the last where too few are given). Each span's ΔW
    is computed once, on one thread at one intra-op thread: by a helper, or by the caller where no helper has
    claimed it yet. The caller must be done with a ΔW before it asks for the next but one. On exit (an
    exception included) nothing is left running."""
    cols = base[0].numel() if base.shape[0] else 0
    depth = helpers_for(spans, base.device)
    if depth < 1 or len(buffers) < 2:
        yield ((r0, r1, delta_fn(base, r0, r1, buffers[0][: (r1 - r0) * cols])) for r0, r1 in spans)
        return
    # a ring of depth + 1 buffers: span j may be computed once the caller is done with span j - depth - 1
    ring = (*buffers, *(torch.empty_like(buffers[-1]) for _ in range(depth + 1 - len(buffers))))

    def compute(i: int) -> torch.Tensor:
        r0, r1 = spans[i]
        return delta_fn(base, r0, r1, ring[i % (depth + 1)][: (r1 - r0) * cols])

    with claimed(len(spans), depth, compute) as claims:
        yield ((r0, r1, claims.take(i)) for i, (r0, r1) in enumerate(spans))


class Claims(Generic[T]):
    """Which spans' work (ΔW, or a whole block: blocks.py) is claimed and done: helpers claim the next span
    the window has room for; the caller, waiting for span i, does span i itself where no helper has claimed
    it, else the next unclaimed span in the window, and waits only where none is left (a descheduled helper
    costs one span's wait at most)."""

    def __init__(self, count: int, depth: int, compute: Callable[[int], T]) -> None:
        self.count, self.depth, self.compute = count, depth, compute
        self.claimed = 0  # spans [0, claimed) are claimed; claims go in order
        self.taken = 0  # the caller has asked for spans [0, taken): span taken - 1 is in its hands
        self.done: dict[int, T | BaseException] = {}
        self.stopped = False
        self.changed = threading.Condition()

    def _claim(self) -> int | None:
        """The next span the ring has room for, claimed (call with the lock held); None where none is."""
        limit = min(self.count, self.taken + self.depth)  # the caller holds span taken - 1's buffer
        if self.stopped or self.claimed >= limit:
            return None
        self.claimed += 1
        return self.claimed - 1

    def _run(self, i: int, kept: type[BaseException] = Exception) -> None:
        # a failure is handed to the caller when it asks for span i (the caller's own interrupt propagates)
        try:
            result: T | BaseException = self.compute(i)
        except kept as exc:
            result = exc
        with self.changed:
            self.done[i] = result
            self.changed.notify_all()

    def help(self) -> None:
        """A helper's loop: claim, compute, until stopped or every span is claimed."""
        while True:
            with self.changed:
                i = self._claim()
                while i is None and not self.stopped and self.claimed < self.count:
                    self.changed.wait()
                    i = self._claim()
                if i is None:
                    return
            self._run(i, BaseException)

    def take(self, i: int, keep: bool = False) -> T:
        """Span i's result (the caller is done with span i - 1's); `keep`: left in `done` until the caller
        `forget`s it (a block written but not yet in the caller's record is then still found, to put back)."""
        with self.changed:
            self.taken = i + 1
            self.changed.notify_all()  # the window moved: a helper may claim one more
        mine: int | None
        while True:
            with self.changed:
                if i in self.done:
                    result = self.done[i] if keep else self.done.pop(i)
                    break
                if self.claimed == i:  # no helper has claimed it: the caller computes it
                    self.claimed, mine = i + 1, i
                else:
                    mine = self._claim()  # a later span, while a helper computes span i
                if mine is None:
                    self.changed.wait()
                    continue
            self._run(mine)
        if isinstance(result, BaseException):
            raise result
        return result

    def forget(self, i: int) -> None:
        with self.changed:
            self.done.pop(i, None)

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()


@contextmanager
def claimed(
    count: int, depth: int, compute: Callable[[int], T], window: int | None = None
) -> Iterator[Claims[T]]:
    """Claims of `count` spans with `depth` helper threads (each at torch's one intra-op thread), at most
    `window` (default `depth`) spans done ahead of the caller; on exit (an exception included) the helpers
    are stopped and joined: nothing of theirs is left running."""
    claims = Claims(count, window or depth, compute)
    shared = _HELPERS.get()
    if shared is None:
        with ThreadPoolExecutor(depth, thread_name_prefix="loraweave-delta") as pool:
            for _ in range(depth):
                pool.submit(claims.help)
            try:
                yield claims
            finally:
                claims.stop()  # the pool's exit waits for a helper's span in flight
        return
    if not shared or shared[0][1] < depth:
        if shared:
            shared.pop()[0].shutdown()
        shared.append((ThreadPoolExecutor(depth, thread_name_prefix="loraweave-delta"), depth))
    helping = [shared[0][0].submit(claims.help) for _ in range(depth)]
    try:
        yield claims
    finally:
        claims.stop()
        for started in helping:
            started.cancel()  # one not started yet never will (a pass inside a pass cannot wait on it)
        wait(helping)  # a helper's span in flight ends before the pass returns: nothing of it left running


@contextmanager
def shared_helpers() -> Iterator[None]:
    """Within: the passes' helper threads are started once and reused pass after pass (starting and joining
    them for every layer cost ~1.5 ms a layer: 24 fp32 3072² layers at 2 threads took 255-290 ms to merge
    with them, 188-213 ms without; issue 39); joined on exit."""
    if _HELPERS.get() is not None:
        yield
        return
    pools: HelperPools = []
    token = _HELPERS.set(pools)
    try:
        yield
    finally:
        _HELPERS.reset(token)
        for pool, _ in pools:
            pool.shutdown()


def each_span(count: int, work: Callable[[int, B], None], buffers: list[B]) -> None:
    """work(i, buffers of the thread running it) for every span i < count, on the caller and up to
    len(buffers) - 1 helper threads (each at one intra-op thread), each span once; returns when all are done,
    raising the first failure in span order (nothing left running)."""
    helpers = min(len(buffers) - 1, count - 1)
    if helpers < 1:
        for i in range(count):
            work(i, buffers[0])
        return
    free, lock, local = list(buffers), threading.Lock(), threading.local()

    def run(i: int) -> None:
        mine = getattr(local, "buffers", None)
        if mine is None:
            with lock:
                mine = local.buffers = free.pop()
        work(i, mine)

    with claimed(count, helpers, run, window=2 * (helpers + 1)) as claims:
        for i in range(count):
            claims.take(i)


def row_spans(total: int, chunk_rows: int) -> list[tuple[int, int]]:
    """The blocks of rows [0, total) a pass runs: chunk_rows each, the last one shorter."""
    return [(r0, min(total, r0 + chunk_rows)) for r0 in range(0, total, chunk_rows)]


def helpers_for(spans: list[tuple[int, int]], device: torch.device) -> int:
    """The helper threads a pass over `spans` on `device` takes: the spare threads recorded_threads lent it
    (CPU only), at most MAX_AHEAD and one fewer than the spans."""
    return min(_SPARE.get(), MAX_AHEAD, len(spans) - 1) if device.type == "cpu" else 0
