"""The fused merge's blocks on several threads (issue 39): each block, its ΔW and its native kernel call, is
merged whole by whichever thread claims it (threads.Claims), with a record of its own; the caller takes the
blocks' records in order and joins them into the layer's record (`restep`), bit for bit what one thread
writes. A pass of one thread's memory bandwidth was twice PEFT's `addmm_` on 2 idle cores.

A block's own record counts its first miss from the position before the block; joined, that first step counts
from the previous block's last miss instead (its filler entries re-made), so the joined record is the one the
serial kernel writes. On any exception the blocks merged but not yet joined are put back from their own
records before it propagates; the joined ones are the caller's (inplace.merge_in_place puts them back)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .native import Kernel
from .threads import claimed
from .undo import GAP_ENCODINGS, GUARDS, DeltaFn, acc_dtype, bits, combine_into, decode_gaps

STEP = GAP_ENCODINGS["gaps8"][1]  # the largest step an entry holds; a longer one is preceded by fillers (0)
WIDE_STEP = GAP_ENCODINGS["gaps"][1]  # the same for the 2-byte encoding, counted to size it


@dataclass
class BlockRecord:
    """One block merged on its own: "gaps8" entries whose first step counts from r0·cols - 1, W's bits at
    the misses, guards (positions, W's and W''s bits), and the kernel's counters."""

    r0: int
    r1: int
    gaps: torch.Tensor
    vals: torch.Tensor
    guards: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    misses: int
    bad: int  # values made non-finite
    last: int  # the flat position of the block's last miss (r0·cols - 1 where none)
    wide_fillers: int  # Σ (step - 1) // 65535 over steps above 65535


class _Buffers:
    """One thread's scratch for its blocks: ΔW, entries, W's bits, guards and the kernel's state (state[0]
    is -1 until the kernel has written block [r0, r1): then the buffers hold its record). The counters are
    read through numpy views and the pointers taken once: a block's Python overhead is paid under the GIL
    that every thread shares."""

    def __init__(self, rows: torch.Tensor, block: int) -> None:
        wb = bits(rows)
        self.delta = torch.empty(block, dtype=acc_dtype(rows.dtype))
        self.gaps = torch.empty(block + block // STEP + 2, dtype=torch.uint8)
        self.vals = torch.empty(block, dtype=wb.dtype)
        self.guard = torch.zeros(1 + GUARDS, dtype=torch.int64)
        self.guard_w, self.guard_m = wb.new_zeros(GUARDS), wb.new_zeros(GUARDS)
        self.state = torch.tensor([-1, 0, 0, 0, 0], dtype=torch.int64)
        self.counts, self.guarded = self.state.numpy(), self.guard.numpy()  # the same memory
        self.outputs = tuple(
            t.data_ptr() for t in (self.gaps, self.vals, self.guard, self.guard_w, self.guard_m, self.state)
        )
        self.r0 = self.r1 = 0

    def written(self) -> BlockRecord | None:
        """The record of the block the kernel wrote last (None before any)."""
        misses, bad, last, entries, wide = self.counts.tolist()
        if misses < 0:
            return None
        g = int(self.guarded[0])
        guards = (
            (self.guard[1 : 1 + g].clone(), self.guard_w[:g].clone(), self.guard_m[:g].clone())
            if g
            else NO_GUARDS[self.vals.dtype]
        )
        gaps, vals = self.gaps[:entries].clone(), self.vals[:misses].clone()
        return BlockRecord(self.r0, self.r1, gaps, vals, guards, misses, bad, last, wide)


NO_GUARDS = {
    dtype: (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype), torch.zeros(0, dtype=dtype))
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64)
}  # shared, never written: a block without a changed element (the usual one after the first)


def merge_block(
    rows: torch.Tensor, r0: int, r1: int, delta: torch.Tensor, kernel: Kernel, buf: _Buffers
) -> BlockRecord:
    """Rows [r0, r1) merged by the kernel (W' written over W), with the block's own record."""
    cols = rows[0].numel()
    buf.guarded[0] = 0  # the kernel fills guards from the count on
    buf.counts[:] = (-1, 0, r0 * cols - 1, 0, 0)
    buf.r0, buf.r1 = r0, r1
    at = rows.data_ptr() + r0 * cols * rows.element_size()
    kernel.fn(at, delta.data_ptr(), (r1 - r0) * cols, r0 * cols, *buf.outputs)
    record = buf.written()
    assert record is not None, "the kernel returned without writing its block"
    return record


def _wide(step: int) -> int:
    return (step - 1) // WIDE_STEP if step > WIDE_STEP else 0


def restep(record: BlockRecord, previous: int, cols: int) -> tuple[torch.Tensor, int]:
    """The block's entries with the first step counted from `previous` (the flat position of the miss before
    the block, -1 where none), and the change in 2-byte fillers that makes."""
    if not record.misses:
        return record.gaps, 0
    start, gaps = record.r0 * cols - 1, record.gaps
    lead = 0 if int(gaps[0]) else int((gaps != 0).to(torch.uint8).argmax())  # fillers before the first step
    old = STEP * lead + int(gaps[lead])
    new = old + start - previous
    if new == old:
        return gaps, 0
    if lead == 0 and new <= STEP:  # the usual case: one entry re-counted (in a copy: until joined, the
        gaps = gaps.clone()  # block's own record must still put it back)
        gaps[0] = new
        return gaps, 0
    fillers = (new - 1) // STEP
    head = torch.zeros(fillers + 1, dtype=torch.uint8)
    head[-1] = new - STEP * fillers
    return torch.cat([head, record.gaps[lead + 1 :]]), _wide(new) - _wide(old)


def put_back(rows: torch.Tensor, record: BlockRecord, delta_fn: DeltaFn) -> None:
    """W of a block merged on its own, from W' and its record: round(W' - ΔW), W's bits at the misses."""
    block = rows[record.r0 : record.r1]
    delta = delta_fn(rows, record.r0, record.r1, None)
    combine_into(block, block, delta, -1, torch.empty_like(delta))
    bits(block).view(-1)[decode_gaps(record.gaps, STEP)] = record.vals  # its steps count from the block


@contextmanager
def parallel_blocks(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    spans: list[tuple[int, int]],
    kernel: Kernel,
    helpers: int,
    joined: Callable[[], int],
) -> Iterator[Iterator[BlockRecord]]:
    """The blocks' records in order, each block merged by the caller or one of `helpers` threads (up to
    2·(helpers + 1) blocks ahead of the caller); `joined()`: the rows the caller's record holds so far."""
    block = max(r1 - r0 for r0, r1 in spans) * rows[0].numel()
    local = threading.local()
    made: list[_Buffers] = []  # every thread's: a block written but not yet handed over is found there
    orphans: list[BlockRecord] = []  # blocks written whose merge then raised

    def merge(i: int) -> BlockRecord:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = _Buffers(rows, block)
            made.append(buf)
        r0, r1 = spans[i]
        delta = delta_fn(rows, r0, r1, buf.delta[: (r1 - r0) * rows[0].numel()])
        try:
            return merge_block(rows, r0, r1, delta, kernel, buf)
        except BaseException:
            orphan = buf.written()  # written, then interrupted: its record is in the buffers only
            if orphan is not None:
                orphans.append(orphan)
            raise

    claims = None
    try:
        with claimed(len(spans), helpers, merge, window=2 * (helpers + 1)) as claims:

            def ordered() -> Iterator[BlockRecord]:
                for i in range(len(spans)):
                    if i:
                        claims.forget(i - 1)  # joined by the caller
                    yield claims.take(i, keep=True)

            yield ordered()
    except BaseException:
        # the helpers have stopped: put back the blocks merged that the caller's record does not hold
        done = claims.done.values() if claims is not None else ()
        handed = [r for r in done if isinstance(r, BlockRecord)]
        # (an interrupt between a kernel call and its hand-over: the record is in that thread's buffers)
        written = [*handed, *orphans, *(r for r in (buf.written() for buf in made) if r is not None)]
        for record in {r.r0: r for r in reversed(written)}.values():  # each block once
            if record.r0 >= joined():
                put_back(rows, record, delta_fn)
        raise
