"""Switching a live handle to a new adapter set: plan the new set (checked like apply), diff it against the
handle's journal, apply the difference. Only layers whose contributions changed are touched.

Per layer, a structure signature (which parts of which adapters land on which rows, stack settings) decides:
- unchanged structure: the runtime path or merge record is re-pointed at the new parts; strengths follow
  (runtime: a scale update; merge: rewritten from the backup only when a strength changed);
- runtime layers that only lost adapters whose terms vanish at strength 0: those are gated to 0 (no
  allocation);
- anything else: the layer's old entry is undone and the new one installed.
Grown inputs and quantized writes own the model's structure or storage: a switch involving them starts
over."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from ..errors import StateError
from ..families.combined import CombinedFactors
from ..families.contribution import Planned
from ..mechanisms.choose import LayerWork, WorkPlan
from ..mechanisms.merge.layer import MergedModule
from ..mechanisms.merge.undo import reused_buffers
from ..mechanisms.runtime.path import RuntimePath
from ..modes import ApplyMode, StackMode
from ..quant import backend_for, reused_branches
from ..report.coverage import warn_incomplete
from ..report.miss import Unmatched
from ..report.report import AppliedModule, Report
from ..resolve.planner import Plan, PlannedPart
from ..resolve.stacking import Contribution
from ..resolve.weights import AdapterWeights
from .decide import NO_ARCH_CHECK, ArchCheck, arch_check, model_arch_of, note_other_arch, refuse
from .install import (
    AdapterSet,
    finish_report,
    install,
    install_layer,
    layer_entry,
    make_report,
    plan_layers,
    resolve_set,
)
from .options import Options
from .state import HandleState

log = logging.getLogger("loraweave")

Key = tuple[object, ...]  # a contribution's identity (switching compares these)


def _has_quantized(p: Plan) -> bool:
    return any(
        backend_for(p.components.modules[pp.component].get_submodule(piece.module)) is not None
        for pp in p.planned
        for piece in pp.pieces
    )


class Signatures:
    """Identity keys of contributions for one switch: each file is stat'ed once, each list keyed once."""

    def __init__(self) -> None:
        self._files: dict[str, Key] = {}
        # id(list) -> (the list, kept alive; its keys)
        self._lists: dict[int, tuple[list[Contribution], list[Key]]] = {}

    def _where(self, pp: Planned) -> Key:
        """The part's file (path + size + mtime: an edited file is another adapter) or its tensors."""
        path = pp.adapter.path
        if not path:
            return tuple(id(pp.adapter.tensor(k)) for k in sorted(pp.part.keys))
        if path not in self._files:
            try:
                st = os.stat(path)
                self._files[path] = (path, st.st_size, st.st_mtime_ns)
            except OSError:
                self._files[path] = (path,)
        return self._files[path]

    def _part(self, pp: Planned) -> Key:
        # The adapter's name too: one file given twice ("f", "f#2") is two adapters with their own strengths.
        return (pp.adapter.name, *self._where(pp), pp.part.stem, pp.part.family, pp.scale)

    def keys(self, contribs: list[Contribution]) -> list[Key]:
        hit = self._lists.get(id(contribs))
        if hit is not None and hit[0] is contribs:
            return hit[1]
        out: list[Key] = []
        for pp, piece in contribs:
            sources = pp.factors.sources if isinstance(pp.factors, CombinedFactors) else None
            if (
                sources
            ):  # a combined part is its sources and settings, strengths included (they change the result)
                inner = tuple(
                    sorted(
                        (*self._part(s), p.src_start, p.dst_start, p.length, s.strength) for s, p in sources
                    )
                )
                out.append(("combined", pp.factors.mode, pp.factors.density, inner))
            else:
                out.append((*self._part(pp), piece.src_start, piece.dst_start, piece.length))
        self._lists[id(contribs)] = (contribs, out)
        return out

    def structure(self, contribs: list[Contribution]) -> tuple[Key, ...]:
        return tuple(sorted(self.keys(contribs), key=repr))

    def mapping(
        self, old_contribs: list[Contribution], new_contribs: list[Contribution]
    ) -> dict[int, PlannedPart]:
        """id(old part) -> new part of the same identity, for re-pointing a path or merge record."""
        new_by_key = dict(zip(self.keys(new_contribs), (pp for pp, _ in new_contribs), strict=True))
        return {
            id(pp): new_by_key[k]
            for k, (pp, _) in zip(self.keys(old_contribs), old_contribs, strict=True)
            if k in new_by_key
        }


def switch_runtime(sig: Signatures, path: RuntimePath, new_contribs: list[Contribution]) -> bool:
    """Re-point or gate an existing path; False when the layer must be rebuilt."""
    old_contribs = path.contributions
    new_keys = set(sig.keys(new_contribs))
    if not new_keys <= set(sig.keys(old_contribs)) or any(
        isinstance(pp.factors, CombinedFactors) for pp, _ in new_contribs
    ):
        return False
    remap = sig.mapping(old_contribs, new_contribs)
    live = {pp.adapter.name for pp, _ in new_contribs}
    dropped = {
        pp.adapter.name for pp, _ in old_contribs if id(pp) not in remap and pp.adapter.name not in live
    }
    if not all(path.vanishes_at_zero(name) for name in dropped):
        return False  # strength 0 is not "absent" for it (DoRA magnitude, OFT rescale): rebuild without it
    for name in dropped:
        path.gates[name] = 0.0
    for name in live:
        path.gates.pop(name, None)
    path.rebind(remap)  # refreshes the scales
    return True


def switch_merged(sig: Signatures, record: MergedModule, new_contribs: list[Contribution]) -> bool:
    """Same structure: re-point and rewrite only if a strength changed; False when it must be redone."""
    if sig.structure(record.contributions) != sig.structure(new_contribs):
        return False
    remap = sig.mapping(record.contributions, new_contribs)
    before = [(pp.strength, pp.scale) for pp, _ in record.contributions]
    record.contributions = [Contribution(remap.get(id(pp), pp), piece) for pp, piece in record.contributions]
    record.adapters = {pp.adapter.name for pp, _ in record.contributions}
    if [(pp.strength, pp.scale) for pp, _ in record.contributions] != before:
        record.write()
    return True


@dataclass
class NewSet:
    """The set a switch moves to, planned and checked like apply before anything changes."""

    plan: Plan
    settings: dict[str, AdapterWeights]
    options: Options
    mode: ApplyMode
    work: WorkPlan
    unmatched: list[Unmatched]
    t0: float
    arch: ArchCheck = NO_ARCH_CHECK  # the new set's files of another architecture (let through: opted in)

    def report(self, applied: list[AppliedModule]) -> Report:
        return finish_report(self.plan, self.mode, applied, self.unmatched, self.work, self.t0)


def _plan_switch(
    state: HandleState,
    adapters: AdapterSet,
    strength: float,
    stack: StackMode,
    density: float | None,
    allow_other_arch: bool = False,
) -> NewSet:
    """Plan the new set with the handle's settings but the stack (compile buckets and undo settings carried
    over; bucket floors shared); every refusal apply would make, and the undo checks, come before any
    change."""
    t0 = time.perf_counter()
    options = dataclasses.replace(state.options, stack=stack, density=density)
    options.check()  # compile_friendly: a stack mode that breaks the graph is refused here too
    components = state.live_plan().components
    if state.resolve_cache is None:
        from ..resolve.cache import ResolveCache

        state.resolve_cache = ResolveCache(components)
    p, settings = resolve_set(components, adapters, strength, cache=state.resolve_cache)
    arch = arch_check(p.adapters, model_arch_of(components), allow_other_arch)
    mode = options.layer_mode(len(p.adapters))  # the same refusals as apply, before anything changes
    state.check_undoable()
    for (
        rec
    ) in state.merged():  # fused (undo='none') or a changed source file: refused before anything changes
        rec.check_undo(rewrite=True)
    wp, unmatched = plan_layers(p, options, mode)
    # What apply refuses whatever strict: another architecture's file, keys trained on other inputs (a
    # switch never refused strict or empty sets).
    refuse(make_report(p, mode, [], unmatched, t0), strict=False, allow_empty=True, arch=arch)
    return NewSet(p, settings, options, mode, wp, unmatched, t0, arch)


def _must_start_over(state: HandleState, new: NewSet) -> bool:
    """Grown inputs and quantized writes own the model's structure or storage, and parameter patches are not
    per-layer records either: a switch involving any of them starts over."""
    return bool(
        state.grown()
        or state.quant()
        or any(pp.grow for pp in new.plan.planned)
        or _has_quantized(new.plan)
        or state.live_plan().params
        or new.plan.params
    )


def _start_over(state: HandleState, new: NewSet) -> None:
    """Undo everything, then install the new set into the same journal (it is empty in between)."""
    with reused_branches():  # a layer written before and after refills its joined side channel in place
        state.journal.undo()
        state.detached.clear()
        try:
            with state.journal.transaction():
                applied = install(state.journal, new.plan, new.work, new.mode, new.options)
        except BaseException:
            state.active = False
            raise
    _commit(
        state, new, new.report(applied), {"kept": 0, "reattached": 0, "rebuilt": len(applied), "dropped": 0}
    )


class LayerDiff:
    """The new set's layers against the journal, one layer at a time: kept (re-pointed), reattached (a path
    this layer carried before), rebuilt, or dropped (no longer touched)."""

    def __init__(self, state: HandleState, new: NewSet) -> None:
        self.journal, self.new = state.journal, new
        self.old_runtime = self.journal.by_module(RuntimePath)
        self.old_merged = self.journal.by_module(MergedModule)
        self.detached = state.detached  # what the last switch took off
        self.now_detached: dict[tuple[int, Key], RuntimePath] = {}  # what this one takes off
        self.sig = Signatures()
        self.applied: list[AppliedModule] = []
        self.counts = {"kept": 0, "reattached": 0, "rebuilt": 0, "dropped": 0}
        self.seen: set[int] = set()

    def run(self) -> None:
        for item in self.new.work.work:
            self.seen.add(id(item.module))
            rp, rec = self.old_runtime.get(id(item.module)), self.old_merged.get(id(item.module))
            if not self.keep(item, rp, rec):
                self.rebuild(item, rp, rec)
        self.drop_rest()

    def keep(self, item: LayerWork, rp: RuntimePath | None, rec: MergedModule | None) -> bool:
        """Same structure: the old entry re-pointed at the new parts; False when the layer must be rebuilt."""
        if not (
            (rp is not None and item.mechanism == "runtime" and switch_runtime(self.sig, rp, item.contribs))
            or (rec is not None and item.mechanism == "merge" and switch_merged(self.sig, rec, item.contribs))
        ):
            return False
        self.counts["kept"] += 1
        entry = layer_entry(item, item.why if self.new.mode == "auto" else "")
        self.applied.append(entry)
        if item.mechanism == "merge" and rec is not None:  # a kept merge layer is its old record
            rec.attach_entry(entry)
        return True

    def rebuild(self, item: LayerWork, rp: RuntimePath | None, rec: MergedModule | None) -> None:
        """Undo the layer's old entry (a runtime path is kept aside for a later switch back) and install the
        new."""
        if rp is not None:
            self.now_detached[(id(item.module), self.sig.structure(rp.contributions))] = rp
        self.journal.undo([e for e in (rp, rec) if e is not None])
        before = self.counts["reattached"]
        new = self.new
        self.applied.append(
            install_layer(self.journal, item, new.mode, new.work, new.options, path_for=self.reattach)
        )
        self.counts["rebuilt"] += self.counts["reattached"] == before

    def reattach(self, module: torch.nn.Module, contribs: list[Contribution]) -> RuntimePath | None:
        """Back to a set this layer carried before: re-attach its path, nothing rebuilt."""
        rp = self.detached.get((id(module), self.sig.structure(contribs)))
        if rp is not None:
            rp.gates.clear()
            rp.rebind(self.sig.mapping(rp.contributions, contribs))
            self.counts["reattached"] += 1
        return rp

    def drop_rest(self) -> None:
        """Layers the new set does not touch: undone (runtime paths kept aside for a later switch back)."""
        gone = [
            e
            for e in self.journal.entries
            if isinstance(e, (RuntimePath, MergedModule)) and id(e.module) not in self.seen
        ]
        for rp in gone:
            if isinstance(rp, RuntimePath):
                self.now_detached[(id(rp.module), self.sig.structure(rp.contributions))] = rp
        self.counts["dropped"] += len(gone)
        self.journal.undo(gone)


def _switch_layers(state: HandleState, new: NewSet) -> LayerDiff:
    diff = LayerDiff(state, new)
    try:
        with reused_buffers():  # undo and merge scratch shared by every layer (no per-layer allocations)
            diff.run()
    except BaseException:
        # Old and new layers are mixed at this point: leave the model clean (no adapters) rather than
        # half-switched.
        state.journal.undo()
        state.detached.clear()
        state.active = False
        raise
    state.detached = diff.now_detached
    return diff


def _commit(state: HandleState, new: NewSet, report: Report, counts: dict[str, int]) -> None:
    note_other_arch(report, new.arch)
    state.adopt(new.plan, new.settings, new.options, report)  # the new set comes with its own strengths
    warn_incomplete(report)
    state.start_selection()  # a select mode starts on the subject; any other mode drops the old selection
    state.last_switch = counts
    log.info(
        "loraweave switch layers_kept=%d layers_reattached=%d layers_rebuilt=%d layers_dropped=%d %s",
        counts["kept"],
        counts["reattached"],
        counts["rebuilt"],
        counts["dropped"],
        report.summary(),
    )


def switch(
    state: HandleState,
    adapters: AdapterSet,
    strength: float = 1.0,
    stack: StackMode = "sum",
    density: float | None = None,
    allow_other_arch: bool = False,
) -> None:
    """Make the handle whose state this is represent a new adapter set on the same target (the caller holds
    the model's lock); a file of another architecture is refused as apply refuses it, unless
    `allow_other_arch`."""
    if not state.active:
        raise StateError("handle was removed")
    new = _plan_switch(state, adapters, strength, stack, density, allow_other_arch)
    if _must_start_over(state, new):
        return _start_over(state, new)
    diff = _switch_layers(state, new)
    _commit(state, new, new.report(diff.applied), diff.counts)
