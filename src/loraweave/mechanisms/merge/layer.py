"""Merge: add every contribution into the weight, fp32-accumulated and rounded once; undo is bit-exact
(undo.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...errors import UndoError
from ...families.contribution import add_contribution, bias_of, coefficient
from ...report.report import AppliedModule
from ...resolve.stacking import Contribution, adapter_names
from . import inplace
from .checks import UndoSettings, needs_bias, overflow_headroom, refuse_non_finite
from .delta import Term, delta_fn, fused_adder
from .inplace import direct_scratch, merge_direct, merge_in_place
from .native import NATIVE_BLOCKS
from .threads import pass_threads
from .undo import (
    CHUNK_ELEMENTS,
    CompactRecord,
    CopyRecord,
    DeltaFn,
    FusedRecord,
    acc_dtype,
    host_copy,
    merge_with_record,
    recorded_threads,
    scratch,
    tensor_bytes,
)
from .undo_source import SourceRecord

Record = CopyRecord | CompactRecord | SourceRecord | FusedRecord

STACK_ATTR = "_loraweave_merges"  # per-module list of live merges, newest last


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    """The module's `weight` or `bias` tensor (merge_blocker admitted only a tensor weight)."""
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor), f"{name} of a merged layer is a {type(value).__name__}"
    return value


@dataclass(eq=False)  # identity semantics: instances are compared with `is` on the per-module stack
class MergedModule:
    module: torch.nn.Module
    contributions: list[Contribution]
    undo_with: UndoSettings = field(default_factory=UndoSettings)
    layer: tuple[str, str] = ("", "")  # (component, module path): where a source record looks
    record: Record | None = None  # None: the weight was never written
    terms: list[Term] = field(default_factory=list)  # the contributions and strengths the record was made at
    bias_backup: torch.Tensor | None = None
    adapters: set[str] = field(default_factory=set)
    pending: list[Term] | None = None  # undo="none", overflow ruled out: W' is written by fuse(), at commit
    entry: AppliedModule | None = (
        None  # the report's AppliedModule: undo kind and bytes follow strength changes
    )

    def is_top(self) -> bool:
        """Only the latest merge on a module can be undone exactly (each record restores the earlier
        merges)."""
        stack = getattr(self.module, STACK_ATTR, [])
        return bool(stack) and stack[-1] is self

    @property
    def undo_kind(self) -> str:
        return self.record.kind if self.record is not None else "-"

    @property
    def undo_bytes(self) -> int:
        return (self.record.nbytes if self.record is not None else 0) + tensor_bytes(self.bias_backup)

    def check_undo(self, rewrite: bool = False) -> None:
        """Raise (UndoError) before anything is touched when this merge cannot be undone as recorded (or, with
        `rewrite`, rewritten at another strength: a fused merge cannot)."""
        if isinstance(self.record, SourceRecord):
            self.record.check()
        if rewrite and isinstance(self.record, FusedRecord):
            raise UndoError("this merge was fused permanently (undo='none'): its strength cannot change")

    def restore(self) -> None:
        stack = getattr(self.module, STACK_ATTR, [])
        with torch.no_grad():
            self._restore_weight()
            if self.bias_backup is not None and not isinstance(self.record, FusedRecord):
                _tensor(self.module, "bias").data.copy_(self.bias_backup)
        if any(m is self for m in stack):
            stack.remove(self)
        self.record, self.terms, self.bias_backup = None, [], None  # undone: the record's memory is released

    undo = restore  # a journal entry

    def reserve(self) -> None:
        """Allocate the scratch a deferred merge will use (within reused_buffers), so that the writes at
        commit allocate nothing: the one failure left to them would be memory."""
        if self.pending is not None:
            weight = _tensor(self.module, "weight").data
            rows = weight.view(weight.shape[0], -1)
            direct_scratch(rows, self._chunk_rows(rows))

    def fuse(self) -> None:
        """undo="none": keep the merge for good and release the record; a deferred merge is written now, when
        nothing in the apply can fail any more (it has no record to be rolled back from)."""
        if self.pending is not None:
            weight = _tensor(self.module, "weight").data
            rows = weight.view(weight.shape[0], -1)
            with torch.no_grad(), recorded_threads(pass_threads(rows.device)):
                fused = fused_adder(self.pending, rows)
                merge_direct(rows, delta_fn(self.pending), self._chunk_rows(rows), fused)
            self.pending = None
        self.record, self.bias_backup = FusedRecord(), None
        self._report()

    def _restore_weight(self) -> None:
        if (
            self.record is not None
        ):  # ΔW as it was merged: parts may have been re-pointed or re-strengthened since
            terms = self.terms
            self.record.restore(_tensor(self.module, "weight").data, delta_fn(terms))

    def write(self, fresh: bool = False) -> None:
        """(Re)compute W' = W + Σ coeff·ΔW from W, the weight before this merge, and record how to undo it.

        Not fresh: W is first restored from the current record (bit-exact), so strength changes never drift.
        The new record is complete before the weight is written: an interruption leaves a restorable state."""
        if isinstance(self.record, FusedRecord):
            raise UndoError("this merge was fused permanently (undo='none'): it cannot be rewritten")
        weight = _tensor(self.module, "weight").data
        with torch.no_grad(), recorded_threads(pass_threads(weight.device)):  # threads.py: why one
            rows = (
                weight.view(weight.shape[0], -1)
                if weight.is_contiguous()
                else weight.reshape(weight.shape[0], -1)
            )
            terms = [(pp, piece, pp.strength, pp.scale) for pp, piece in self.contributions]
            kept_copy = None
            if not fresh and isinstance(self.record, CopyRecord) and self._in_place_kind(rows) == "auto":
                self._restore_weight()  # W back from its copy, then merged as a fresh layer (that copy kept
                kept_copy, fresh = self.record, True  # again where most elements miss: copy_is_smaller)
            in_place = self._in_place_kind(rows) if fresh else None
            if in_place == "transient" and self._overflow_free(rows, terms):
                self.pending, self.terms = terms, terms  # no record, no finite check: fuse() writes it
                self._write_bias()
                self._report()
                return
            if in_place is not None and self._merge_in_place(rows, terms, in_place):
                self._write_bias()
                self._report()
                return
            if not fresh and isinstance(self.record, CompactRecord):
                kind = self._in_place_kind(rows)
                if kind in ("auto", "compact"):
                    self._rewrite_in_place(self.record, rows, terms, kind)
                    self._write_bias()
                    self._report()
                    return
            # a fresh merge here whose in-place pass found a copy smaller: the weight holds W, kept whole
            copy = "copy" if in_place is not None else None
            old = None if fresh else self.record
            record, merged, original = self._merge(rows, terms, old, copy, kept_copy)
            refuse_non_finite(merged, original, self.adapters)  # before the weight is touched
            del original
            self.record, self.terms = record, terms
            weight.copy_(merged.view(weight.shape))
            del merged
            self._write_bias()
        self._report()

    def _in_place_kind(self, rows: torch.Tensor) -> str | None:
        """The record kind of a fused in-place merge (inplace.py), or None where the buffered path must run: W
        read by ΔW (needs_base, weight replacement), whole copies (ties/dare, undo="copy") and file
        records."""
        if not rows.is_contiguous() or any(
            pp.part.family in ("set", "combined") or pp.family.needs_base for pp, _ in self.contributions
        ):
            return None
        return {"auto": "auto", "compact": "compact", "none": "transient"}.get(self.undo_with.kind)

    def _rewrite_in_place(self, old: CompactRecord, rows: torch.Tensor, terms: list[Term], kind: str) -> None:
        """A strength change over a compact record: W rebuilt from W' and the record into a scratch copy
        (checked against its witnesses), merged there at the new strengths by the fused path with its new
        record, then copied over the weight in one step. Any failure before that copy leaves the weight and
        record as they were."""
        base = scratch("base", rows.numel(), rows.dtype, rows.device).view(rows.shape)
        with recorded_threads(old.threads):
            old.rebuild_rows(rows, base, delta_fn(self.terms))
        old.verify(base)
        made: list[Record] = []
        if not merge_in_place(
            base,
            delta_fn(terms),
            kind,
            self._chunk_rows(base),
            self.undo_with.on_device,
            self.adapters,
            made.append,
        ):  # most elements miss: W (in `base`) kept whole, W' beside it
            chunk = max(1, CHUNK_ELEMENTS // max(1, base.shape[1]))
            merged, _ = merge_with_record(base, delta_fn(terms), "none", chunk)
            refuse_non_finite(merged, base, self.adapters)
            made.append(CopyRecord(host_copy(base, self.undo_with.on_device)))
            base = merged
        rows.copy_(base)
        self.record, self.terms = made[0], terms

    def _overflow_free(self, rows: torch.Tensor, terms: list[Term]) -> bool:
        """True when W + ΔW cannot turn a finite value non-finite: Σ|coeff|·bound (each family's declared
        bound on |ΔW|) is under half the headroom above the dtype's largest finite value (so fp32 rounding of
        ΔW and of the sum cannot reach the overflow threshold). False where any family declares no bound."""
        total = 0.0
        for pp, piece, strength, scale in terms:
            bound = pp.family.delta_bound(pp.factors, piece.src_start, piece.length)
            if bound is None:
                return False
            total += abs(strength * scale) * bound
        return total * 2 < overflow_headroom(rows.dtype)  # False for inf/nan

    @staticmethod
    def _chunk_rows(rows: torch.Tensor) -> int:
        # the native kernel keeps only ΔW's block in cache (it streams W): 4x larger blocks, 4x fewer calls
        native = rows.device.type == "cpu" and inplace.kernel_for(rows.dtype) is not None  # the path it takes
        return max(1, CHUNK_ELEMENTS * (NATIVE_BLOCKS if native else 1) // max(1, rows.shape[1]))

    def _merge_in_place(self, rows: torch.Tensor, terms: list[Term], kind: str) -> bool:
        """False where the pass found a copy smaller (the weight unchanged): the caller merges with a copy."""

        def keep(record: Record) -> None:
            self.record, self.terms = record, terms

        return merge_in_place(
            rows,
            delta_fn(terms),
            kind,
            self._chunk_rows(rows),
            self.undo_with.on_device,
            self.adapters,
            keep,
        )

    def _merge(
        self,
        rows: torch.Tensor,
        terms: list[Term],
        old: Record | None,
        kind: str | None = None,
        kept: CopyRecord | None = None,
    ) -> tuple[Record, torch.Tensor, torch.Tensor]:
        """W', its record (of `kind`, by default the one the settings ask) and W; `old` (a rewrite): the
        record W comes back from first (the weight holds W'); `kept`: a copy of W (the weight holds W) kept as
        the record instead of a new one."""
        if any(pp.part.family == "set" for pp, _ in self.contributions):
            return self._merge_over(rows, terms, old)
        kind = kind or self._record_kind()
        needs_base = any(pp.family.needs_base for pp, _ in self.contributions)
        chunk = rows.shape[0] if needs_base else max(1, CHUNK_ELEMENTS // max(1, rows.shape[1]))
        prior: tuple[CompactRecord, torch.Tensor, DeltaFn] | None = None
        base = rows
        keep: CopyRecord | SourceRecord | None = kept
        if isinstance(old, CompactRecord) and rows.is_contiguous():  # W rebuilt block by block beside W'
            prior = (old, rows, delta_fn(self.terms))
            base = scratch("base", rows.numel(), rows.dtype, rows.device).view(rows.shape)
        elif old is not None:
            self._restore_weight()  # W back in place from its copy or its file; those records stay valid
            keep = (
                old
                if isinstance(old, SourceRecord) or (isinstance(old, CopyRecord) and kind == "copy")
                else None
            )
        elif self.undo_with.kind == "source" and self.undo_with.sources is not None:
            keep = self.undo_with.sources.record(*self.layer, rows)  # checked against the file's bytes
        with recorded_threads(prior[0].threads if prior is not None else torch.get_num_threads()):
            merged, record = merge_with_record(
                base,
                delta_fn(terms),
                "none" if keep is not None else kind,
                chunk,
                needs_base,
                self.undo_with.on_device,
                prior,
            )
        if keep is not None:
            return keep, merged, base
        assert record is not None, "merge_with_record keeps a record of every kind but none"
        return record, merged, base

    def _record_kind(self) -> str:
        """The undo record a merge of these contributions keeps."""
        if any(pp.part.family == "combined" for pp, _ in self.contributions):
            # ties/dare: inner strengths live in their sources, which a strength change rewrites
            return "copy"
        # "none" keeps a record until apply has finished; "source" falls back where no 1:1 tensor exists.
        return "auto" if self.undo_with.kind in ("source", "none") else self.undo_with.kind

    def _merge_over(
        self,
        rows: torch.Tensor,
        terms: list[Term],
        old: Record | None,
    ) -> tuple[Record, torch.Tensor, torch.Tensor]:
        """Weight replacement reads W in its target (to write t itself, not W + (t - W)): added over W,
        copied."""
        if old is not None:
            self._restore_weight()
        acc = rows.to(acc_dtype(rows.dtype), copy=True)
        for pp, piece, strength, scale in terms:
            add_contribution(
                acc[piece.dst_start : piece.dst_start + piece.length],
                pp,
                piece,
                rows,
                strength=strength,
                scale=scale,
            )
        record = (
            old
            if isinstance(old, (CopyRecord, SourceRecord))
            else CopyRecord(host_copy(rows, self.undo_with.on_device))
        )
        return record, acc.to(rows.dtype), rows

    def attach_entry(self, entry: AppliedModule) -> None:
        """The report row this layer keeps current: its undo kind and bytes follow strength changes."""
        self.entry = entry
        self._report()

    def _report(self) -> None:
        if self.entry is not None:
            self.entry.undo, self.entry.undo_bytes = self.undo_kind, self.undo_bytes

    def _write_bias(self) -> None:
        deltas = []
        live = getattr(self.module, "bias", None)
        original = (
            self.bias_backup if self.bias_backup is not None else live
        )  # before the first write: untouched
        for pp, piece in self.contributions:
            b = bias_of(pp, piece, original)
            if b is not None:
                deltas.append((piece, b, coefficient(pp)))
        if not deltas:
            return
        bias = _tensor(self.module, "bias")
        if self.bias_backup is None:
            self.bias_backup = host_copy(bias, self.undo_with.on_device)
        acc = self.bias_backup.to(bias.device, acc_dtype(bias.dtype), copy=True)
        for piece, b, coeff in deltas:
            acc[piece.dst_start : piece.dst_start + piece.length].add_(b, alpha=coeff)
        bias.data.copy_(acc)
        refuse_non_finite(bias.data, self.bias_backup, self.adapters)


def merge_module(
    module: torch.nn.Module,
    contributions: list[Contribution],
    record: list[MergedModule] | Callable[[MergedModule], object],
    undo: UndoSettings | None = None,
    layer: tuple[str, str] = ("", ""),
) -> MergedModule:
    """Merge into `module`; the undo record goes to `record` (a list's append, or a journal's record) before
    the weight is touched. undo: the record kind (apply's `undo`); layer: (component, path), where a source
    is."""
    if needs_bias(contributions) and getattr(module, "bias", None) is None:
        raise ValueError("adapter carries a bias delta but the module has no bias")
    merged = MergedModule(module, contributions, undo or UndoSettings(), layer)
    merged.adapters = adapter_names(contributions)
    if not hasattr(module, STACK_ATTR):
        setattr(module, STACK_ATTR, [])
    getattr(module, STACK_ATTR).append(merged)
    (record.append if isinstance(record, list) else record)(merged)
    merged.write(fresh=True)
    return merged
