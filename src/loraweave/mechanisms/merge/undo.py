"""Undo records of a merged weight: how the weight before a merge (W) comes back, bit for bit.

Kinds (chosen per layer by `apply(undo=...)`, smallest first under "auto"):
- compact: W is recomputed as round(W' - ΔW) from the merged weight W' and the adapter's own factors (the same
  fp32 ΔW computation, on the same device with the same thread count as the merge); the record keeps W's bits
  only where that recomputation misses, positions packed as uint16 gaps or as a bitmask, whichever is smaller.
- copy: a full copy of W (where a compact record would be larger).
- source: W is re-read from the safetensors file the model came from (see `undo_source`).
- none: a permanent fuse; nothing is kept once apply has finished.

A record of an accelerator weight lives in host memory (pinned when CUDA is there), unless asked otherwise."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace

import torch

from ...errors import UndoError
from .bitscan import differ, insert_zeros, pack_positions, put, unpack_positions
from .native import Combine, combine_for, decoder_for
from .threads import block_deltas, each_span, helpers_for, row_spans, shared_helpers
from .threads import recorded_threads as recorded_threads  # re-exported: quantized/write.py uses it

# gap encodings: entry dtype and the largest step one entry holds (a longer gap takes valueless filler
# entries)
GAP_ENCODINGS = {"gaps": (torch.uint16, 65535), "gaps8": (torch.uint8, 255)}
CHUNK_ELEMENTS = 1 << 18  # rows per block of a merge: its fp32 temporaries stay in cache
WITNESSES = 256  # evenly spaced elements checked after a compact restore (catches a non-deterministic ΔW)
GUARDS = 8  # elements where W' differs from W: tell a written weight from one never written
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# (weight rows (out, in·k) that W-dependent families read, r0, r1, out) -> Σ coeff·ΔW of rows [r0, r1), fp32;
# out: None or a flat fp32 buffer of at least (r1 - r0)·in·k elements the result may be written to
DeltaFn = Callable[[torch.Tensor, int, int, "torch.Tensor | None"], torch.Tensor]
_POOL: ContextVar[dict[tuple[object, ...], torch.Tensor] | None] = ContextVar(
    "loraweave_merge_buffers", default=None
)


@contextmanager
def reused_buffers() -> Iterator[None]:
    """Within: a merge's W' buffer and block temporaries are kept and reused layer after layer (each fresh
    allocation of the same size costs page faults again), and the passes' helper threads; all of it is
    released on exit."""
    token = _POOL.set({})
    try:
        with shared_helpers():  # the block passes' helper threads too
            yield
    finally:
        _POOL.reset(token)


def scratch(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of `numel` elements: from the pool (grown to the largest size asked) within
    reused_buffers."""
    pool = _POOL.get()
    if pool is None:
        return torch.empty(numel, dtype=dtype, device=device)
    key = (name, dtype, device)
    buf = pool.get(key)
    if buf is None or buf.numel() < numel:
        pool.pop(key, None)  # the smaller one goes before the larger is allocated
        pool[key] = buf = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern as integers: comparisons are bitwise (-0.0 vs 0.0, NaN payloads, fp8)."""
    return t.view(_BITS[t.element_size()])


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return (
        torch.float64 if dtype == torch.float64 else torch.float32
    )  # fp64 weights keep fp64; fp8 does not promote


def host_copy(t: torch.Tensor, on_device: bool = False) -> torch.Tensor:
    """A real copy (never an alias: `.to("cpu")` of a CPU tensor is the same tensor), on the host unless
    asked."""
    t = t.detach()
    if t.device.type in ("cpu", "meta") or on_device:
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    out.copy_(t)
    return out


def tensor_bytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass(eq=False)
class CopyRecord:
    backup: torch.Tensor
    kind: str = "copy"

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.backup)

    def restore(self, weight: torch.Tensor, delta_fn: DeltaFn) -> None:
        weight.copy_(self.backup.view(weight.shape))


@dataclass(eq=False)
class FusedRecord:
    """undo="none": the merge is permanent; restore leaves the weight merged."""

    kind: str = "none"
    nbytes: int = 0

    def restore(self, weight: torch.Tensor, delta_fn: DeltaFn) -> None:
        return None


def witness_positions(numel: int) -> torch.Tensor:
    # integer math: float32 linspace cannot hold every index above 2**24 (it rounded past the end)
    count = min(WITNESSES, numel)
    if count <= 1:
        return torch.zeros(count, dtype=torch.long)
    steps = torch.arange(count, dtype=torch.long)
    return (steps * (numel - 1) + (count - 1) // 2) // (count - 1)


@dataclass(frozen=True)
class _Fill:
    """CompactRecord.rebuild's fill(r0, r1, delta=None) and the buffer it computes ΔW into."""

    fill: Callable[[int, int, torch.Tensor | None, torch.Tensor | None], None]
    buffer: torch.Tensor
    acc: torch.Tensor  # the sum's buffer (another thread passes its own)

    def __call__(
        self, r0: int, r1: int, delta: torch.Tensor | None = None, acc: torch.Tensor | None = None
    ) -> None:
        self.fill(r0, r1, delta, acc)


@dataclass(eq=False)
class CompactRecord:
    """W = round(W' - ΔW) corrected at the stored positions; see the module docstring."""

    encoding: str  # "gaps"/"gaps8": uint16/uint8 steps to the next position; "bitmask": one bit per element;
    # "raw": int64 positions (a record kept only while apply runs)
    positions: torch.Tensor
    values: torch.Tensor  # W's bits at the positions (integer view of the weight dtype)
    witness: torch.Tensor  # W's bits at witness_positions(numel)
    guard_pos: torch.Tensor  # where W' and W differ (a few), with both bit patterns
    guard_w: torch.Tensor
    guard_merged: torch.Tensor
    chunk_rows: int  # ΔW is recomputed in blocks of rows exactly as it was computed at the merge
    threads: int
    device: torch.device
    kind: str = "compact"

    @property
    def nbytes(self) -> int:
        return tensor_bytes(
            self.positions, self.values, self.witness, self.guard_pos, self.guard_w, self.guard_merged
        )

    def written(self, wb: torch.Tensor) -> bool:
        """False when the weight still holds W (the merge never reached it): nothing to undo."""
        if not self.guard_pos.numel():
            return True  # W' == W everywhere: restoring recomputes W exactly either way
        now = wb[self.guard_pos.to(wb.device)].cpu()
        if torch.equal(now, self.guard_merged):
            return True
        if torch.equal(now, self.guard_w):
            return False
        raise UndoError(
            "the merged weight was changed outside loraweave since the merge: a compact undo record "
            "cannot restore it (use undo='copy' or 'source' for weights edited in place)"
        )

    def restore(self, weight: torch.Tensor, delta_fn: DeltaFn) -> None:
        work = weight if weight.device == self.device else weight.to(self.device)
        rows = work.view(work.shape[0], -1)
        if not self.written(bits(rows).view(-1)):
            return
        with recorded_threads(self.threads):
            self.rebuild_rows(rows, rows, delta_fn)
        self.verify(rows)
        if work is not weight:
            weight.copy_(work)

    def rebuild_rows(
        self, merged: torch.Tensor, out: torch.Tensor, delta_fn: DeltaFn, rows: int | None = None
    ) -> None:
        """W's first `rows` rows (all by default) written into `out` from W' (`merged`), block by block (the
        next block's ΔW computed ahead where a thread is spare: threads.block_deltas)."""
        end = out.shape[0] if rows is None else rows
        fill = self.rebuild(merged, out, delta_fn)
        spans = row_spans(end, self.chunk_rows)
        block = min(out.shape[0], self.chunk_rows) * out[0].numel()
        helpers = helpers_for(spans, out.device)
        try:  # (a rollback runs this too: where the helpers' buffers do not fit, the caller does it alone)
            own = [(torch.empty_like(fill.buffer), torch.empty_like(fill.buffer)) for _ in range(helpers)]
        except (RuntimeError, MemoryError):
            helpers = 0
        if helpers > 0:  # each block whole (ΔW, W' - ΔW, its misses) on whichever thread claims it

            def rebuild_span(i: int, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
                r0, r1 = spans[i]
                n = (r1 - r0) * out[0].numel()
                fill(r0, r1, delta_fn(merged, r0, r1, buffers[0][:n]), buffers[1])

            each_span(len(spans), rebuild_span, [(fill.buffer, fill.acc), *own])
            return
        ahead = scratch("undo_delta_ahead", block, acc_dtype(out.dtype), out.device)
        with block_deltas(delta_fn, merged, spans, (fill.buffer, ahead)) as deltas:
            for r0, r1, delta in deltas:
                fill(r0, r1, delta)

    def rebuild(self, merged: torch.Tensor, out: torch.Tensor, delta_fn: DeltaFn) -> _Fill:
        """fill(r0, r1) writes W's rows [r0, r1) into `out` (which may be `merged` itself), from W' and ΔW
        (computed here unless given); blocks of `chunk_rows`, under the recorded thread count."""
        pos = self.decoded_positions(out.numel(), out.device)
        values = self.values.to(out.device)
        ob, cols = bits(out).view(-1), out[0].numel()
        rows, chunk = out.shape[0], self.chunk_rows
        dbuf, acc = (
            scratch(n, min(rows, chunk) * cols, acc_dtype(out.dtype), out.device)
            for n in ("undo_delta", "undo_acc")
        )
        # where each block's corrections start in `pos`, found once (fill runs per block of chunk_rows)
        edges = torch.arange(0, rows + chunk, chunk, device=pos.device).clamp_(max=rows) * cols
        bounds = torch.searchsorted(pos, edges).tolist()

        def fill(
            r0: int, r1: int, delta: torch.Tensor | None = None, sums: torch.Tensor | None = None
        ) -> None:
            n = (r1 - r0) * cols
            if delta is None:
                delta = delta_fn(merged, r0, r1, dbuf[:n])
            combine_into(
                out[r0:r1], merged[r0:r1], delta, -1, (acc if sums is None else sums)[:n].view(delta.shape)
            )
            lo, hi = bounds[r0 // chunk], bounds[-(-r1 // chunk)]
            put(ob, pos[lo:hi], values[lo:hi])

        return _Fill(fill, dbuf, acc)

    def verify(self, out: torch.Tensor) -> None:
        ob = bits(out).reshape(-1)
        if not torch.equal(ob[witness_positions(ob.numel()).to(ob.device)].cpu(), self.witness.cpu()):
            raise UndoError(
                "compact undo did not reproduce the original weight: ΔW recomputed differently than at "
                "the merge (device, thread count or kernels changed)"
            )

    def decoded_positions(self, numel: int, device: torch.device) -> torch.Tensor:
        p = self.positions.to(device)
        if self.encoding == "raw":
            return p
        if self.encoding in GAP_ENCODINGS:
            return decode_gaps(p, GAP_ENCODINGS[self.encoding][1])
        return unpack_positions(p, numel)


def decode_gaps(entries: torch.Tensor, most: int) -> torch.Tensor:
    """The positions (from -1) that gap entries step to: each entry is a step, a zero a filler worth `most`
    with no value of its own."""
    decode = decoder_for(entries.dtype, most) if entries.device.type == "cpu" else None
    if decode is not None and entries.is_contiguous():
        out = torch.empty(entries.numel(), dtype=torch.int64)
        return out[: decode(entries.data_ptr(), entries.numel(), out.data_ptr())]
    steps = entries.to(torch.int64)
    real = steps != 0
    positions = torch.where(real, steps, most).cumsum(0) - 1
    return positions if bool(real.all()) else positions[real]


def combine(w: torch.Tensor, delta: torch.Tensor, sign: int, out: torch.Tensor) -> torch.Tensor:
    """out = w ± delta in delta's dtype (fp32, or fp64; `out` has delta's dtype and shape), one rounding."""
    if w.element_size() == 1:  # fp8 does not take part in type promotion
        w = w.to(delta.dtype)
    return torch.add(w, delta, alpha=sign, out=out)


def combine_into(
    dst: torch.Tensor, w: torch.Tensor, delta: torch.Tensor, sign: int, acc: torch.Tensor
) -> None:
    """dst = round(w ± delta): computed in delta's dtype and rounded once to dst's, in one pass (the same bits
    as combine then a cast); fp8 goes through `acc` (a buffer of delta's dtype and shape)."""
    if w.element_size() == 1 or dst.element_size() == 1:
        dst.copy_(combine(w, delta, sign, acc))
    elif w.dtype != delta.dtype and (one_pass := _one_pass(dst, w, delta)) is not None:
        one_pass(w.data_ptr(), delta.data_ptr(), dst.data_ptr(), w.numel(), sign)
    elif (
        w.dtype != delta.dtype
    ):  # fp16/bf16: a mixed-dtype add casts element by element (~1.7x slower on CPU);
        acc.copy_(
            w
        )  # the exact upcast, the add and the one rounding as three vectorized passes: the same bits
        acc.add_(delta, alpha=sign)
        dst.copy_(acc)
    else:
        torch.add(w, delta, alpha=sign, out=dst)


def _one_pass(dst: torch.Tensor, w: torch.Tensor, delta: torch.Tensor) -> Combine | None:
    """The native one-pass combine for these tensors (CPU, contiguous, fp32 ΔW), or None."""
    if w.device.type != "cpu" or delta.dtype != torch.float32 or dst.dtype != w.dtype:
        return None
    if not (w.is_contiguous() and dst.is_contiguous() and delta.is_contiguous()) or w.shape != dst.shape:
        return None
    return combine_for(w.dtype) if delta.numel() == w.numel() else None


def compact_sizes(numel: int, steps: torch.Tensor, itemsize: int) -> dict[str, int]:
    """Bytes of each encoding of the misses whose position steps (p[i] - p[i-1], p[-1] = -1) are `steps`: a
    gap encoding pays one valueless filler entry (0) for every `largest step` a gap holds beyond the first."""
    misses = steps.numel()
    longest = steps.max() if misses else None  # one reduction; most records need no filler at all
    fillers = {
        name: filler_count(steps, most) if longest is not None and bool(longest > most) else 0
        for name, (_, most) in GAP_ENCODINGS.items()
    }
    return encoding_sizes(numel, misses, fillers, itemsize)


def encoding_sizes(numel: int, misses: int, fillers: dict[str, int], itemsize: int) -> dict[str, int]:
    """Bytes of each encoding of `misses` misses in a weight of `numel` elements, given each gap encoding's
    filler count."""
    fixed = min(WITNESSES, numel) * itemsize + GUARDS * (8 + 2 * itemsize)
    sizes = {"bitmask": math.ceil(numel / 8) + misses * itemsize + fixed}
    for name, (dtype, _) in GAP_ENCODINGS.items():
        width = torch.empty(0, dtype=dtype).element_size()
        sizes[name] = misses * (width + itemsize) + fillers[name] * width + fixed
    return sizes


def filler_count(steps: torch.Tensor, most: int) -> int:
    """Σ (step - 1) // most: the valueless entries a gap encoding needs, read only from the steps above
    `most`."""
    long = steps[steps > most]
    return int(((long - 1) // most).sum())


def encode_gaps(steps: torch.Tensor, dtype: torch.dtype, most: int) -> torch.Tensor:
    """Position steps as entries of `dtype`: a step above `most` becomes filler zeros (each one `most`
    further) and the rest; the decoder (CompactRecord._positions) skips the fillers. Only the long steps are
    divided."""
    if not steps.numel() or not bool(steps.max() > most):
        return steps.to(dtype)
    long = (steps > most).nonzero().squeeze(1)
    fillers = (steps[long] - 1) // most
    real = steps.clone()
    real[long] -= fillers * most
    return insert_zeros(real, long, fillers).to(dtype)


def _guard_positions(wb: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
    """Up to GUARDS positions where W' and W differ, scanning from the start chunk by chunk."""
    chunk = 1 << 16
    for start in range(0, wb.numel(), chunk):
        idx = (wb[start : start + chunk] != mb[start : start + chunk]).nonzero().squeeze(1)
        if idx.numel():
            return idx[:GUARDS] + start
    return torch.zeros(0, dtype=torch.int64, device=wb.device)


def raw_record(
    rows: torch.Tensor,
    positions: torch.Tensor,
    values: torch.Tensor,
    witness: torch.Tensor,
    guard: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    chunk_rows: int,
    encoding: str = "raw",
) -> CompactRecord:
    """A compact record whose positions are plain int64 (no encoding): complete, kept only while apply runs;
    or, with `encoding`, positions already in that encoding (the native kernel writes "gaps8")."""
    return CompactRecord(
        encoding,
        positions,
        values,
        witness,
        guard[0].cpu(),
        host_copy(guard[1]),
        host_copy(guard[2]),
        chunk_rows,
        torch.get_num_threads(),
        rows.device,
    )


def compact_record(
    rows: torch.Tensor, raw: CompactRecord, on_device: bool, force: bool
) -> CompactRecord | None:
    """The smallest encoding of a raw record's misses; None when a copy of `rows` is smaller, unless
    `force`."""
    misses = raw.positions
    steps = torch.diff(misses, prepend=misses.new_full((1,), -1))
    sizes = compact_sizes(rows.numel(), steps, rows.element_size())
    encoding = min(sizes, key=sizes.__getitem__)
    if sizes[encoding] >= tensor_bytes(rows) and not force:
        return None
    if encoding == "bitmask":
        positions = pack_positions(misses, rows.numel())
    else:
        positions = encode_gaps(steps, *GAP_ENCODINGS[encoding])
    return replace(
        raw,
        encoding=encoding,
        positions=host_copy(positions, on_device),
        values=host_copy(raw.values, on_device),
        witness=host_copy(raw.witness, on_device),
    )


def record_of_misses(
    rows: torch.Tensor,
    merged: torch.Tensor,
    misses: torch.Tensor,
    chunk_rows: int,
    on_device: bool = False,
    force: bool = False,
) -> CompactRecord | None:
    """The compact record of W (`rows`) merged into W' (`merged`) whose undo misses W at the ascending flat
    positions `misses`, in its smallest encoding; None when a copy of W is smaller, unless `force`."""
    wb, mb = bits(rows).reshape(-1), bits(merged).reshape(-1)
    witness = wb[witness_positions(wb.numel()).to(wb.device)]
    guard = _guard_positions(wb, mb)
    raw = raw_record(rows, misses, wb[misses], witness, (guard, wb[guard], mb[guard]), chunk_rows)
    return compact_record(rows, raw, on_device, force)


def merge_with_record(
    rows: torch.Tensor,
    delta_fn: DeltaFn,
    kind: str,
    chunk_rows: int,
    needs_base: bool = False,
    on_device: bool = False,
    prior: tuple[CompactRecord, torch.Tensor, DeltaFn] | None = None,
) -> tuple[torch.Tensor, CopyRecord | CompactRecord | None]:
    """W' = round(W + ΔW) for the (out, in·k) rows of W, block by block of rows (temporaries stay small), and
    the record of `kind` ("compact", "copy", "auto": the smaller, or "none": no record). W is read, never
    written. W' is a scratch buffer (reused by the next layer within reused_buffers): copy it out before the
    next merge.

    needs_base: ΔW reads W (one block only): a compact record recomputes it from W', as an undo will.
    prior: (record, W' rows, its ΔW): `rows` is an empty buffer that each block of W is first rebuilt into
    from the prior compact record (a strength change: W never has to be written back to the weight)."""
    compact = kind in ("auto", "compact") and rows.is_contiguous()
    merged = scratch("merged", rows.numel(), rows.dtype, rows.device).view(rows.shape)
    fill = prior[0].rebuild(prior[1], rows, prior[2]) if prior is not None else None
    if prior is not None and prior[0].chunk_rows != chunk_rows:  # other blocks: rebuild W whole first
        prior[0].rebuild_rows(prior[1], rows, prior[2])
        fill = None
    blocks = _Blocks(rows, chunk_rows, compact)
    for r0 in range(0, rows.shape[0], chunk_rows):
        r1 = min(rows.shape[0], r0 + chunk_rows)
        if fill is not None:
            fill(r0, r1)
        blocks.merge(merged, delta_fn, r0, r1, needs_base)
    if prior is not None:
        prior[0].verify(rows)  # before anything is written
    if kind == "none":  # the caller holds another record (a source file)
        return merged, None
    record = (
        record_of_misses(rows, merged, blocks.misses(), chunk_rows, on_device, kind == "compact")
        if compact
        else None
    )
    return merged, record if record is not None else CopyRecord(host_copy(rows, on_device))


class _Blocks:
    """One merge's block temporaries (allocated once per layer, or reused across layers) and the misses
    found."""

    def __init__(self, rows: torch.Tensor, chunk_rows: int, compact: bool) -> None:
        self.rows, self.cols, self.compact = rows, rows[0].numel(), compact
        self.found: list[torch.Tensor] = []
        block = min(rows.shape[0], chunk_rows) * self.cols
        self.delta, self.acc = (
            scratch(n, block, acc_dtype(rows.dtype), rows.device) for n in ("delta", "acc")
        )
        if compact:
            self.guess = scratch("guess", block, rows.dtype, rows.device)
            self.mask = scratch("miss", block, torch.bool, rows.device)

    def merge(self, merged: torch.Tensor, delta_fn: DeltaFn, r0: int, r1: int, needs_base: bool) -> None:
        """merged[r0:r1] = round(W + ΔW); compact: the flat positions where round(W' - ΔW), what an undo
        computes, misses W."""
        n, w = (r1 - r0) * self.cols, self.rows[r0:r1]
        delta = delta_fn(self.rows, r0, r1, self.delta[:n])
        acc = self.acc[:n].view(delta.shape)
        combine_into(merged[r0:r1], w, delta, 1, acc)
        if not self.compact:
            return
        if needs_base:  # ΔW read from W', as an undo reads it
            delta = delta_fn(merged, r0, r1, self.delta[:n])
        guess = self.guess[:n].view(w.shape)
        combine_into(guess, merged[r0:r1], delta, -1, acc)
        miss = self._differ(guess.view(-1), w.reshape(-1))
        if miss.numel():
            self.found.append(miss + r0 * self.cols)

    def _differ(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Ascending positions where a and b differ bitwise."""
        return differ(bits(a), bits(b), self.mask[: a.numel()])

    def misses(self) -> torch.Tensor:
        return (
            torch.cat(self.found)
            if self.found
            else torch.zeros(0, dtype=torch.int64, device=self.rows.device)
        )
