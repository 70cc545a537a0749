"""The fused merge: W' = round(W + ΔW) written straight into the weight, block by block of rows.

Each block of W is first copied to a cache-sized buffer, then W' is added in place over the weight's lines
just read (W is read from memory once and written back once). While the block is hot its compact record is
taken: where round(W' - ΔW), what an undo computes, misses W, and W's bits there. A value that becomes
non-finite is always such a miss, so the finite check reads only the misses. No weight-sized W' buffer, no
pass over W' to check it, no pass to copy it in. Any exception (a non-finite block, an interrupt, a failed
encoding) puts the block in flight back from its buffer and the blocks written before it from their record,
bit for bit, before it propagates."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from ...errors import NonFiniteResultError
from .bitscan import differ, take
from .blocks import parallel_blocks, restep
from .direct import direct_scratch as direct_scratch  # re-exported: layer.py's names for them
from .direct import merge_direct as merge_direct
from .native import Kernel
from .native import kernel_for as kernel_for  # re-exported: layer.py calls it here (tests patch it)
from .threads import block_deltas, helpers_for, row_spans
from .undo import (
    GAP_ENCODINGS,
    GUARDS,
    CompactRecord,
    CopyRecord,
    DeltaFn,
    acc_dtype,
    bits,
    combine_into,
    compact_record,
    encoding_sizes,
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


def _settled() -> None:
    """Nothing left in flight."""


@dataclass
class _Progress:
    """What a fused merge has written so far: rows [0, written) hold W' and their misses are in the lists; a
    block in flight is put back by `settle` (torch path: from its saved copy; native: its kernel finished
    it)."""

    found: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    guards: list[list[torch.Tensor]] = field(default_factory=lambda: [[], [], []])  # where, W's, W''s bits
    written: int = 0
    flight: torch.Tensor | int | None = None  # the block in flight (torch: its rows; native: its end row)
    encoding: str = "raw"  # of the positions in `found`: int64 (torch path) or "gaps8" entries (native)
    fillers: dict[str, int] = field(default_factory=dict)  # per gap encoding, for sizing (native)
    settle: Callable[[], None] = _settled


def merge_in_place(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    kind: str,
    chunk_rows: int,
    on_device: bool,
    adapters: set[str],
    keep: Callable[[CompactRecord | CopyRecord], None],
) -> bool:
    """Merge into `rows` (the weight's contiguous (out, in·k) view) in place; ΔW must not read W (no
    needs_base). Returns False, with the weight unchanged and nothing kept, where kind "auto" or "transient"
    finds early that most elements miss (see `copy_is_smaller`): the caller merges with a copy instead.

    kind: "compact", "auto" (a copy where that is smaller, rebuilt from W' and the misses) or "transient"
    (undo="none": the misses kept unencoded, only until apply has finished; encoded as "auto" when that raw
    record would exceed 1/8 of the weight). `keep(record)` takes the record: it is the last step, and on any
    exception up to its end the weight is rebuilt, so the caller never holds a written weight without its
    record. Raises NonFiniteResultError, with the weight unchanged, when the merge would make finite values
    non-finite. On the CPU the blocks go through the native kernel (native.py) where one was built; the same
    bits."""
    early = kind != "compact"
    spans = row_spans(rows.shape[0], chunk_rows)
    if early and len(spans) >= SAMPLED_FROM and copy_is_smaller(rows, *sampled_misses(rows, delta_fn)):
        return False  # decided from a few rows, before any block is written
    wb = bits(rows).view(-1)
    witness = wb[witness_positions(wb.numel()).to(wb.device)]  # W's bits, before any block is written
    kernel = kernel_for(rows.dtype) if rows.device.type == "cpu" else None
    done = _Progress()
    try:
        helpers = helpers_for(spans, rows.device)
        if kernel is not None and helpers > 0:
            _blocks_shared(rows, delta_fn, spans, kernel, helpers, done, adapters, early)
        elif kernel is not None:
            _blocks_native(rows, delta_fn, chunk_rows, kernel, done, adapters, early)
        else:
            _blocks_torch(rows, delta_fn, chunk_rows, done, adapters, early)
        raw = _raw(rows, done, witness, chunk_rows)
        if done.encoding == "gaps8":
            record = _native_record(rows, raw, done, on_device, kind)
        else:
            record = raw if kind == "transient" and raw.nbytes <= tensor_bytes(rows) // 8 else None
            if record is None:
                record = compact_record(rows, raw, on_device, kind == "compact")
        keep(record if record is not None else _copy_of_original(rows, raw, delta_fn, on_device))
        return True
    except BaseException as exc:
        done.settle()
        if done.written:
            _raw(rows, done, witness, chunk_rows).rebuild_rows(rows, rows, delta_fn, done.written)
        if isinstance(exc, CopySmaller):
            return False
        raise
    finally:
        # settle closes over `done` and the block buffers: left in place, that cycle would keep each layer's
        # buffers and miss lists alive until Python's cyclic collector happens to run
        done.settle = _settled


class CopySmaller(Exception):
    """Raised inside merge_in_place (and handled there) when a copy is the smaller record."""


def copy_is_smaller(rows: torch.Tensor, misses: int, written: int) -> bool:
    """True when `misses` misses in the first `written` rows, extrapolated to every row, make a compact
    record at least as large as a copy of `rows` (its least size: a byte of position and W's bits a miss).
    Checked on a sample before the pass (sampled_misses) and after every block: a 65504-valued factor makes
    most elements miss, and their record costs more to write than the copy it would replace (issue 39)."""
    expected = misses * rows.shape[0] / max(1, written)
    least = min(rows.numel() / 8, expected) + expected * rows.element_size()
    return least >= tensor_bytes(rows)


SAMPLE_SPANS, SAMPLE_ROWS = 4, 2  # rows read by sampled_misses: 4 evenly spaced spans of 2 rows
# layers of fewer blocks are not sampled: the check after their first block costs them less than a sample
# (~0.5 ms a layer: 0.4 s of an SDXL strength change, whose 635 of 794 layers are 1-3 blocks)
SAMPLED_FROM = 4


def sampled_misses(rows: torch.Tensor, delta_fn: DeltaFn) -> tuple[int, int]:
    """(misses, rows sampled): round(round(W + ΔW) - ΔW) against W on a few evenly spaced rows, with the
    arithmetic of the merge itself, nothing written. A layer whose ΔW dwarfs W (a 65504-valued factor) is then
    merged with a copy straight away: trying a first block in place cost ~13 % of the copy path (issue 39)."""
    total = rows.shape[0]
    if total < SAMPLE_ROWS:
        return 0, 0
    starts = sorted({min(total - SAMPLE_ROWS, k * total // SAMPLE_SPANS) for k in range(SAMPLE_SPANS)})
    sampled = SAMPLE_ROWS * len(starts)
    shape = (sampled, *rows.shape[1:])
    delta = torch.empty(shape, dtype=acc_dtype(rows.dtype), device=rows.device)
    for k, r0 in enumerate(starts):  # ΔW span by span (the blocks' own arithmetic), then one check for all
        part = delta[k * SAMPLE_ROWS : (k + 1) * SAMPLE_ROWS]
        got = delta_fn(rows, r0, r0 + SAMPLE_ROWS, part.view(-1))
        if got.data_ptr() != part.data_ptr():  # a ΔW function that wrote elsewhere
            part.copy_(got.view_as(part))
    picked = torch.tensor([r0 + i for r0 in starts for i in range(SAMPLE_ROWS)], device=rows.device)
    w, acc = rows.index_select(0, picked), torch.empty_like(delta)
    merged, guess = torch.empty_like(w), torch.empty_like(w)
    combine_into(merged, w, delta, 1, acc)
    if new_non_finite(merged, w):
        return 0, 0  # no decision: the pass refuses the overflow, naming its rows
    combine_into(guess, merged, delta, -1, acc)
    return int((bits(guess) != bits(w)).sum()), sampled


def _refuse(bad: int, adapters: set[str], r0: int, r1: int, rows: torch.Tensor) -> None:
    raise NonFiniteResultError(
        f"merging {', '.join(sorted(adapters)) or 'the adapters'} gives {bad} non-finite values "
        f"in rows {r0}-{r1} of a {tuple(rows.shape)} {rows.dtype} weight (the delta overflows); "
        "the layer is left as it was"
    )


def _blocks_torch(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    chunk_rows: int,
    done: _Progress,
    adapters: set[str],
    early: bool,
) -> None:
    """Each block of W copied to a cache-sized buffer, W' added over the weight's lines just read, and the
    block's misses found while it is hot (compare and scan through numpy)."""
    cols, total = rows[0].numel(), rows.shape[0]
    block = min(total, chunk_rows) * cols
    dbuf, ahead, acc = (
        scratch(n, block, acc_dtype(rows.dtype), rows.device) for n in ("delta", "delta_ahead", "acc")
    )
    saved, gbuf = (scratch(n, block, rows.dtype, rows.device) for n in ("original", "guess"))
    mask = scratch("miss", block, torch.bool, rows.device)

    def put_back() -> None:  # the block in flight has its W in `saved` until its misses are kept
        if isinstance(done.flight, torch.Tensor):
            done.flight.copy_(saved[: done.flight.numel()].view(done.flight.shape))

    done.settle = put_back
    with block_deltas(delta_fn, rows, row_spans(total, chunk_rows), (dbuf, ahead)) as deltas:
        for r0, r1, delta in deltas:
            _block_torch(rows, r0, r1, delta, done, adapters, (saved, gbuf, mask, acc))
            if early and copy_is_smaller(rows, sum(v.numel() for v in done.values), r1):
                raise CopySmaller


def _block_torch(
    rows: torch.Tensor,
    r0: int,
    r1: int,
    delta: torch.Tensor,
    done: _Progress,
    adapters: set[str],
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """One block of _blocks_torch: W saved, W' written, the block's misses (and guards) kept."""
    saved, gbuf, mask, acc = buffers
    cols = rows[0].numel()
    wb = bits(rows).view(-1)
    n = (r1 - r0) * cols
    w, merged_bits = rows[r0:r1], wb[r0 * cols : r1 * cols]
    original = saved[:n].view(w.shape)
    original.copy_(w)  # W's block stays in cache; W' is added in place over lines already read
    done.flight = w
    combine_into(w, w, delta, 1, acc[:n].view(delta.shape))
    wflat = bits(original).view(-1)
    have = sum(g.numel() for g in done.guards[0])
    if have < GUARDS:  # they tell a written weight from one never written
        at = differ(merged_bits, wflat, mask[:n])[: GUARDS - have]
        for dst, src in zip(done.guards, (at + r0 * cols, wflat[at], merged_bits[at]), strict=True):
            dst.append(src)
    guess = gbuf[:n].view(w.shape)
    combine_into(guess, w, delta, -1, acc[:n].view(delta.shape))
    miss = differ(bits(guess).view(-1), wflat, mask[:n])
    if miss.numel():
        was = take(wflat, miss)
        # a new non-finite W' is always a miss (inf - ΔW or NaN never gives a finite W back): check only
        # these
        bad = new_non_finite(take(merged_bits, miss).view(rows.dtype), was.view(rows.dtype))
        if bad:
            _refuse(bad, adapters, r0, r1, rows)
        done.values, done.found = [*done.values, was], [*done.found, miss + r0 * cols]
    done.flight, done.written = None, r1  # one step for signals: no call or jump between the two stores


def _blocks_native(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    chunk_rows: int,
    kernel: Kernel,
    done: _Progress,
    adapters: set[str],
    early: bool,
) -> None:
    """Each block in one kernel call: W' written, misses (as "gaps8" entries) and guards found in the same
    pass (native.py). A call cannot be interrupted: a block is untouched or written with its misses in the
    buffers."""
    cols, total = rows[0].numel(), rows.shape[0]
    wb = bits(rows).view(-1)
    block = min(total, chunk_rows) * cols
    dbuf, ahead = (scratch(n, block, torch.float32, rows.device) for n in ("delta", "delta_ahead"))
    vals = scratch("miss_was", block, wb.dtype, rows.device)
    guard = torch.zeros(1 + GUARDS, dtype=torch.int64)
    guard_w, guard_m = wb.new_zeros(GUARDS), wb.new_zeros(GUARDS)
    # misses (-1 until the kernel has written the block), new non-finite, last position, entries, gaps16
    # fillers
    state = torch.tensor([-1, 0, -1, 0, 0], dtype=torch.int64)
    done.encoding, done.fillers = "gaps8", {name: 0 for name in GAP_ENCODINGS}
    gaps = scratch("miss_gaps", 1, torch.uint8, rows.device)
    misses = [0]

    def keep_finished() -> None:  # idempotent; the lists and `written` change in one step
        count, end = int(state[0]), done.flight
        if count < 0 or not isinstance(end, int) or end <= done.written:
            return
        at, was, g = gaps[: int(state[3])].clone(), vals[:count].clone(), int(guard[0])
        guards = [[guard[1 : 1 + g].clone()], [guard_w[:g].clone()], [guard_m[:g].clone()]]
        misses[0] += count
        fillers = {
            "gaps8": done.fillers["gaps8"] + int(state[3]) - count,
            "gaps": done.fillers["gaps"] + int(state[4]),
        }
        done.found, done.values, done.guards, done.fillers, done.written = (
            [*done.found, at],
            [*done.values, was],
            guards,
            fillers,
            end,
        )

    done.settle = keep_finished
    with block_deltas(delta_fn, rows, row_spans(total, chunk_rows), (dbuf, ahead)) as deltas:
        for r0, r1, delta in deltas:
            n = (r1 - r0) * cols
            room = n + (r1 * cols - int(state[2])) // 255 + 2  # every miss plus the longest gap's fillers
            gaps = scratch("miss_gaps", room, torch.uint8, rows.device)
            state[0] = -1
            done.flight = r1
            kernel.fn(
                wb[r0 * cols :].data_ptr(),
                delta.data_ptr(),
                n,
                r0 * cols,
                gaps.data_ptr(),
                vals.data_ptr(),
                guard.data_ptr(),
                guard_w.data_ptr(),
                guard_m.data_ptr(),
                state.data_ptr(),
            )
            keep_finished()
            if int(state[1]):
                _refuse(int(state[1]), adapters, r0, r1, rows)
            if early and copy_is_smaller(rows, misses[0], r1):
                raise CopySmaller


def _blocks_shared(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    spans: list[tuple[int, int]],
    kernel: Kernel,
    helpers: int,
    done: _Progress,
    adapters: set[str],
    early: bool,
) -> None:
    """_blocks_native with the blocks merged on the caller and `helpers` spare threads (blocks.py), joined
    into the record in order: the same bits and the same record as one thread writes."""
    cols = rows[0].numel()
    done.encoding, done.fillers = "gaps8", {name: 0 for name in GAP_ENCODINGS}
    previous, misses = -1, 0
    with parallel_blocks(rows, delta_fn, spans, kernel, helpers, lambda: done.written) as records:
        for record in records:
            gaps, wide = restep(record, previous, cols)
            have = sum(g.numel() for g in done.guards[0])
            guards = (
                [[*kept, new[: GUARDS - have]] for kept, new in zip(done.guards, record.guards, strict=True)]
                if have < GUARDS and record.guards[0].numel()
                else done.guards
            )
            fillers = {
                "gaps8": done.fillers["gaps8"] + gaps.numel() - record.misses,
                "gaps": done.fillers["gaps"] + record.wide_fillers + wide,
            }
            done.found, done.values, done.guards, done.fillers, done.written = (
                [*done.found, gaps],
                [*done.values, record.vals],
                guards,
                fillers,
                record.r1,
            )
            previous = record.last if record.misses else previous
            misses += record.misses
            if record.bad:
                _refuse(record.bad, adapters, record.r0, record.r1, rows)
            if early and copy_is_smaller(rows, misses, record.r1):
                raise CopySmaller


def _native_record(
    rows: torch.Tensor, raw: CompactRecord, done: _Progress, on_device: bool, kind: str
) -> CompactRecord | None:
    """The kernel's "gaps8" record where that is the smallest encoding (the usual case: no second pass over
    the misses); else the misses decoded and encoded again; None where a copy is smaller (kind "auto")."""
    misses = raw.values.numel()
    sizes = encoding_sizes(rows.numel(), misses, done.fillers, rows.element_size())
    best = min(sizes, key=sizes.__getitem__)
    if kind == "transient" or (best == "gaps8" and (kind == "compact" or sizes[best] < tensor_bytes(rows))):
        return raw  # fresh host tensors of their own (the kernel runs on the CPU only)
    positions = raw.decoded_positions(rows.numel(), rows.device)
    return compact_record(
        rows, replace(raw, encoding="raw", positions=positions), on_device, kind == "compact"
    )


def _raw(rows: torch.Tensor, done: _Progress, witness: torch.Tensor, chunk_rows: int) -> CompactRecord:
    wb = bits(rows).view(-1)
    found, values = done.found, done.values
    positions = torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=rows.device)
    g_pos, g_w, g_m = (
        torch.cat(g) if g else like.new_zeros(0)
        for g, like in zip(done.guards, (positions, wb, wb), strict=True)
    )
    guard = (g_pos, g_w, g_m)
    if done.encoding != "raw" and not found:
        positions = torch.zeros(0, dtype=torch.uint8, device=rows.device)
    values_all = torch.cat(values) if values else wb.new_zeros(0)
    return raw_record(rows, positions, values_all, witness, guard, chunk_rows, done.encoding)


def _copy_of_original(
    rows: torch.Tensor, raw: CompactRecord, delta_fn: DeltaFn, on_device: bool
) -> CopyRecord:
    """undo="auto" where a copy is smaller than the misses: W rebuilt from W' (now in the weight) into the
    copy."""
    original = torch.empty_like(rows)
    with recorded_threads(raw.threads):
        raw.rebuild_rows(rows, original, delta_fn)
    raw.verify(original)
    return CopyRecord(original if original.device.type == "cpu" or on_device else host_copy(original))
