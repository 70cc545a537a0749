"""Switching a live handle to a new adapter set: plan the new set (checked like apply), diff it against the
handle's journal, apply the difference. Only layers whose contributions changed are touched.

Per layer, a structure signature (which parts of which adapters land on which rows, stack settings) decides:
- unchanged structure: the runtime path or merge record is re-pointed at the new parts; strengths follow
  (runtime: a scale update; merge: rewritten from the backup only when a strength changed);
- runtime layers that only lost adapters whose terms vanish at strength 0: those are gated to 0 (no allocation);
- anything else: the layer's old entry is undone and the new one installed.
Grown inputs and quantized writes own the model's structure or storage: a switch involving them starts over."""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from ..families.combined import CombinedFactors
from ..mechanisms.merge.layer import MergedModule
from ..mechanisms.runtime.path import RuntimePath
from ..quant import backend_for
from ..report.coverage import warn_incomplete
from ..report.report import AppliedModule
from ..resolve.planner import Plan, PlannedPart
from ..resolve.stacking import Contribution
from .install import finish_report, install, install_layer, layer_entry, plan_layers, resolve_set
from .options import Options

log = logging.getLogger("loraweave")


def _has_quantized(p: Plan) -> bool:
    return any(
        backend_for(p.components.modules[pp.component].get_submodule(piece.module)) is not None
        for pp in p.planned
        for piece in pp.pieces
    )


class Signatures:
    """Identity keys of contributions for one switch: each file is stat'ed once, each list keyed once."""

    def __init__(self) -> None:
        self._files: dict[str, tuple] = {}
        self._lists: dict[int, tuple[list, list[tuple]]] = {}  # id(list) -> (the list, kept alive; its keys)

    def _where(self, pp: PlannedPart) -> tuple:
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

    def _part(self, pp: PlannedPart) -> tuple:
        # The adapter's name too: one file given twice ("f", "f#2") is two adapters with their own strengths.
        return (pp.adapter.name, *self._where(pp), pp.part.stem, pp.part.family, pp.scale)

    def keys(self, contribs: list) -> list[tuple]:
        hit = self._lists.get(id(contribs))
        if hit is not None and hit[0] is contribs:
            return hit[1]
        out = []
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

    def structure(self, contribs: list) -> tuple:
        return tuple(sorted(self.keys(contribs), key=repr))

    def mapping(self, old_contribs: list, new_contribs: list) -> dict[int, PlannedPart]:
        """id(old part) -> new part of the same identity, for re-pointing a path or merge record."""
        new_by_key = dict(zip(self.keys(new_contribs), (pp for pp, _ in new_contribs), strict=True))
        return {
            id(pp): new_by_key[k]
            for k, (pp, _) in zip(self.keys(old_contribs), old_contribs, strict=True)
            if k in new_by_key
        }


def switch_runtime(sig: Signatures, path: RuntimePath, new_contribs: list) -> bool:
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


def switch_merged(sig: Signatures, record: MergedModule, new_contribs: list) -> bool:
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


def _start_over(handle, p: Plan, settings, options: Options, mode: str, wp, unmatched, t0: float) -> None:
    """Undo everything, then install the new set into the same journal (it is empty in between)."""
    handle.journal.undo()
    handle._detached.clear()
    try:
        with handle.journal.transaction():
            applied = install(handle.journal, p, wp, mode, options)
    except BaseException:
        handle.active = False
        raise
    _commit(
        handle,
        p,
        settings,
        options,
        finish_report(p, mode, applied, unmatched, wp, t0),
        {"kept": 0, "reattached": 0, "rebuilt": len(applied), "dropped": 0},
    )


def _commit(handle, p: Plan, settings, options: Options, report, counts: dict[str, int]) -> None:
    handle._plan, handle._settings, handle.options, handle.report = p, settings, options, report
    handle._disabled = {}  # the new set comes with its own strengths
    warn_incomplete(report)
    handle.start_selection()  # a select mode starts on the subject; any other mode drops the old selection
    handle.last_switch = counts
    log.info(
        "loraweave switch layers_kept=%d layers_reattached=%d layers_rebuilt=%d layers_dropped=%d %s",
        counts["kept"],
        counts["reattached"],
        counts["rebuilt"],
        counts["dropped"],
        report.summary(),
    )


def switch(handle, adapters, strength: float = 1.0, stack: str = "sum", density: float | None = None) -> None:
    """Make `handle` represent a new adapter set on the same target (the caller holds the model's lock)."""
    if not handle.active:
        raise RuntimeError("handle was removed")
    t0 = time.perf_counter()
    old = handle.options
    # Same settings but the stack (compile buckets and undo settings carried over; bucket floors shared).
    options = dataclasses.replace(old, stack=stack, density=density)
    options.check()  # compile_friendly: a stack mode that breaks the graph is refused here too
    components = handle._plan.components
    if handle._resolve_cache is None:
        from ..resolve.cache import ResolveCache

        handle._resolve_cache = ResolveCache(components)
    p, settings = resolve_set(components, adapters, strength, cache=handle._resolve_cache)
    mode = options.layer_mode(len(p.adapters))  # the same refusals as apply, before anything changes
    handle.check_undoable()
    for (
        rec
    ) in handle._merged:  # fused (undo='none') or a changed source file: refused before anything changes
        rec.check_undo(rewrite=True)
    wp, unmatched = plan_layers(p, options, mode)
    # Parameter patches are not per-layer records either: start over, like grown inputs and quantized writes.
    if (
        handle._grown
        or handle._quant
        or any(pp.grow for pp in p.planned)
        or _has_quantized(p)
        or handle._plan.params
        or p.params
    ):
        return _start_over(handle, p, settings, options, mode, wp, unmatched, t0)
    journal = handle.journal
    old_runtime, old_merged = journal.by_module(RuntimePath), journal.by_module(MergedModule)
    detached, now_detached = handle._detached, {}
    sig = Signatures()
    applied: list[AppliedModule] = []
    counts = {"kept": 0, "reattached": 0, "rebuilt": 0, "dropped": 0}
    seen: set[int] = set()

    def reattach(module, contribs):
        """Back to a set this layer carried before: re-attach its path, nothing rebuilt."""
        rp = detached.get((id(module), sig.structure(contribs)))
        if rp is not None:
            rp.gates.clear()
            rp.rebind(sig.mapping(rp.contributions, contribs))
            counts["reattached"] += 1
        return rp

    try:
        for item in wp.work:
            module, mechanism, contribs = item.module, item.mechanism, item.contribs
            seen.add(id(module))
            rp, rec = old_runtime.get(id(module)), old_merged.get(id(module))
            if (rp is not None and mechanism == "runtime" and switch_runtime(sig, rp, contribs)) or (
                rec is not None and mechanism == "merge" and switch_merged(sig, rec, contribs)
            ):
                counts["kept"] += 1
                applied.append(layer_entry(item, item.why if mode == "auto" else ""))
                if mechanism == "merge":
                    rec.entry = applied[-1]
                    rec._report()
                continue
            if rp is not None:
                now_detached[(id(module), sig.structure(rp.contributions))] = rp
            journal.undo([e for e in (rp, rec) if e is not None])
            before = counts["reattached"]
            applied.append(install_layer(journal, item, mode, wp, options, path_for=reattach))
            counts["rebuilt"] += counts["reattached"] == before
        gone = [
            e
            for e in journal.entries
            if isinstance(e, (RuntimePath, MergedModule)) and id(e.module) not in seen
        ]
        for rp in gone:
            if isinstance(rp, RuntimePath):
                now_detached[(id(rp.module), sig.structure(rp.contributions))] = rp
        counts["dropped"] += len(gone)
        journal.undo(gone)
    except BaseException:
        # Old and new layers are mixed at this point: leave the model clean (no adapters) rather than half-switched.
        journal.undo()
        handle._detached.clear()
        handle.active = False
        raise
    handle._detached = now_detached
    _commit(handle, p, settings, options, finish_report(p, mode, applied, unmatched, wp, t0), counts)
