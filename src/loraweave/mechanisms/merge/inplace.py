"""The fused merge: W' = round(W + ΔW) written straight into the weight, block by block of rows.

Each block of W is first copied to a cache-sized buffer, then W' is added in place over the weight's lines just
read (W is read from memory once and written back once). While the block is hot its compact record is taken:
where round(W' - ΔW), what an undo computes, misses W, and W's bits there. A value that becomes non-finite is
always such a miss, so the finite check reads only the misses. No weight-sized W' buffer, no pass over W' to
check it, no pass to copy it in. Any exception (a non-finite block, an interrupt, a failed encoding) puts the
block in flight back from its buffer and the blocks written before it from their record, bit for bit, before it
propagates."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...errors import NonFiniteResultError
from .bitscan import differ
from .undo import (
    GUARDS,
    CompactRecord,
    CopyRecord,
    DeltaFn,
    acc_dtype,
    bits,
    combine_into,
    compact_record,
    host_copy,
    raw_record,
    recorded_threads,
    scratch,
    tensor_bytes,
    witness_positions,
)


def new_non_finite(written: torch.Tensor, original: torch.Tensor) -> int:
    """How many values of `written` are non-finite where `original` (same shape) was finite."""
    try:
        lo, hi = torch.aminmax(written)
        if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
            return 0
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax here: the elementwise test below
        pass
    return int((~torch.isfinite(written.float()) & torch.isfinite(original.view_as(written).float())).sum())


def merge_in_place(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    kind: str,
    chunk_rows: int,
    on_device: bool,
    adapters: set[str],
    keep: Callable[[CompactRecord | CopyRecord], None],
) -> None:
    """Merge into `rows` (the weight's contiguous (out, in·k) view) in place; ΔW must not read W (no needs_base).

    kind: "compact", "auto" (a copy where that is smaller, rebuilt from W' and the misses) or "transient"
    (undo="none": the misses kept unencoded, only until apply has finished; encoded as "auto" when that raw
    record would exceed 1/8 of the weight). `keep(record)` takes the record: it is the last step, and on any
    exception up to its end the weight is rebuilt, so the caller never holds a written weight without its record.
    Raises NonFiniteResultError, with the weight unchanged, when the merge would make finite values non-finite."""
    cols, total = rows[0].numel(), rows.shape[0]
    wb = bits(rows).view(-1)
    block = min(total, chunk_rows) * cols
    dbuf, acc = (scratch(n, block, acc_dtype(rows.dtype), rows.device) for n in ("delta", "acc"))
    saved, gbuf = (scratch(n, block, rows.dtype, rows.device) for n in ("original", "guess"))
    mask = scratch("miss", block, torch.bool, rows.device)
    witness = wb[witness_positions(wb.numel()).to(wb.device)]  # W's bits, before any block is written
    found: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    guards: list[list[torch.Tensor]] = [
        [],
        [],
        [],
    ]  # where W' differs from W (a few), W's and W''s bits there
    written = 0  # rows of the weight that hold W' and are in the record
    dirty = None  # the block being written: its W is in `saved` until its record is complete
    try:
        for r0 in range(0, total, chunk_rows):
            r1 = min(total, r0 + chunk_rows)
            n = (r1 - r0) * cols
            w, merged_bits = rows[r0:r1], wb[r0 * cols : r1 * cols]
            delta = delta_fn(rows, r0, r1, dbuf[:n])
            original = saved[:n].view(w.shape)
            original.copy_(w)  # W's block stays in cache; W' is added in place over lines already read
            dirty = w
            combine_into(w, w, delta, 1, acc[:n].view(delta.shape))
            wflat = bits(original).view(-1)
            have = sum(g.numel() for g in guards[0])
            if have < GUARDS:  # they tell a written weight from one never written
                at = differ(merged_bits, wflat, mask[:n])[: GUARDS - have]
                for dst, src in zip(guards, (at + r0 * cols, wflat[at], merged_bits[at]), strict=True):
                    dst.append(src)
            guess = gbuf[:n].view(w.shape)
            combine_into(guess, w, delta, -1, acc[:n].view(delta.shape))
            miss = differ(bits(guess).view(-1), wflat, mask[:n])
            if miss.numel():
                # a new non-finite W' is always a miss (inf - ΔW or NaN never gives a finite W back): check only these
                bad = new_non_finite(w.view(-1)[miss], original.view(-1)[miss])
                if bad:
                    raise NonFiniteResultError(
                        f"merging {', '.join(sorted(adapters)) or 'the adapters'} gives {bad} non-finite values "
                        f"in rows {r0}-{r1} of a {tuple(rows.shape)} {rows.dtype} weight (the delta overflows); "
                        "the layer is left as it was"
                    )
                values.append(wflat[miss])
                found.append(miss + r0 * cols)
            dirty, written = None, r1
        raw = _raw(rows, found, values, witness, guards, chunk_rows)
        record = raw if kind == "transient" and raw.nbytes <= tensor_bytes(rows) // 8 else None
        if record is None:
            record = compact_record(rows, raw, on_device, kind == "compact")
        keep(record if record is not None else _copy_of_original(rows, raw, delta_fn, on_device))
    except BaseException:
        if dirty is not None:
            dirty.copy_(saved[: dirty.numel()].view(dirty.shape))
        if written:
            raw = _raw(rows, found, values, witness, guards, chunk_rows)
            fill = raw.rebuild(rows, rows, delta_fn)
            for r0 in range(0, written, chunk_rows):
                fill(r0, min(written, r0 + chunk_rows))
        raise


def _raw(
    rows: torch.Tensor,
    found: list[torch.Tensor],
    values: list[torch.Tensor],
    witness: torch.Tensor,
    guards: list[list[torch.Tensor]],
    chunk_rows: int,
) -> CompactRecord:
    wb = bits(rows).view(-1)
    positions = torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=rows.device)
    guard = tuple(
        torch.cat(g) if g else like.new_zeros(0) for g, like in zip(guards, (positions, wb, wb), strict=True)
    )
    return raw_record(
        rows, positions, torch.cat(values) if values else wb.new_zeros(0), witness, guard, chunk_rows
    )


def _copy_of_original(
    rows: torch.Tensor, raw: CompactRecord, delta_fn: DeltaFn, on_device: bool
) -> CopyRecord:
    """undo="auto" where a copy is smaller than the misses: W rebuilt from W' (now in the weight) into the copy."""
    original = torch.empty_like(rows)
    with recorded_threads(raw.threads):
        fill = raw.rebuild(rows, original, delta_fn)
        for r0 in range(0, rows.shape[0], raw.chunk_rows):
            fill(r0, min(rows.shape[0], r0 + raw.chunk_rows))
    raw.verify(original)
    return CopyRecord(original if original.device.type == "cpu" or on_device else host_copy(original))
