"""undo="none"'s direct write, W' = round(W + ΔW) block by block with no record (run at commit, once apply
can no longer fail): on the caller and torch's spare threads, each block whole (its ΔW and its write) on
whichever thread claims it. The buffers of every thread are reserved before commit (`direct_scratch`), so
the writes allocate nothing."""

from __future__ import annotations

import torch

from .delta import FusedAdd
from .threads import MAX_AHEAD, block_deltas, each_span, helpers_for, row_spans
from .undo import DeltaFn, acc_dtype, combine_into, scratch

Buffers = tuple[torch.Tensor, torch.Tensor]  # one thread's ΔW and sum, a block each


def merge_direct(
    rows: torch.Tensor, delta_fn: DeltaFn, chunk_rows: int, fused: FusedAdd | None = None
) -> None:
    """W' = round(W + ΔW) written into `rows` block by block, with no record and no finite check: only for
    undo="none" merges whose ΔW was bounded below the dtype's overflow headroom
    (checks.overflow_headroom), run once apply can no longer fail. The same blocks and arithmetic as
    merge_in_place, so the same bits at any thread count; `fused` (delta.fused_adder) writes a block in one
    pass with those bits where it can."""
    cols = rows[0].numel()
    spans = row_spans(rows.shape[0], chunk_rows)
    dbuf, ahead, acc = direct_scratch(rows, chunk_rows)
    helpers = helpers_for(spans, rows.device)
    if helpers < 1:
        with block_deltas(delta_fn, rows, spans, (dbuf, ahead)) as deltas:
            for r0, r1, delta in deltas:
                if fused is not None and fused(rows, r0, r1):
                    continue
                n = (r1 - r0) * cols
                combine_into(rows[r0:r1], rows[r0:r1], delta, 1, acc[:n].view(delta.shape))
        return

    def write(i: int, buffers: Buffers) -> None:
        r0, r1 = spans[i]
        if fused is not None and fused(rows, r0, r1):
            return
        n = (r1 - r0) * cols
        delta = delta_fn(rows, r0, r1, buffers[0][:n])
        combine_into(rows[r0:r1], rows[r0:r1], delta, 1, buffers[1][:n].view(delta.shape))

    each_span(len(spans), write, [(dbuf, acc), *helper_scratch(rows, chunk_rows, helpers)])


def direct_scratch(rows: torch.Tensor, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """merge_direct's block buffers (ΔW, the next block's ΔW and the sum), from the pool, with those of the
    spare threads a pass at torch's thread count now would lend: called early, it reserves them."""
    block = min(rows.shape[0], chunk_rows) * rows[0].numel()
    names = ("delta", "delta_ahead", "acc")
    delta, ahead, acc = (scratch(n, block, acc_dtype(rows.dtype), rows.device) for n in names)
    if rows.device.type == "cpu":
        helper_scratch(rows, chunk_rows, min(torch.get_num_threads() - 1, MAX_AHEAD))
    return delta, ahead, acc


def helper_scratch(rows: torch.Tensor, chunk_rows: int, helpers: int) -> list[Buffers]:
    """Each helper thread's ΔW and sum buffers for merge_direct, from the pool."""
    block = min(rows.shape[0], chunk_rows) * rows[0].numel()
    dtype = acc_dtype(rows.dtype)
    return [
        (scratch(f"delta_{k}", block, dtype, rows.device), scratch(f"acc_{k}", block, dtype, rows.device))
        for k in range(1, helpers + 1)
    ]
