"""Switching a live handle to a new adapter set: only layers whose contributions changed are touched.

Per layer, a structure signature (which parts of which files land on which rows, stack settings) decides:
- unchanged structure: the runtime path or merge record is re-pointed at the new parts; strengths follow
  (runtime: a scale update; merge: rewritten from the backup only when a strength changed);
- runtime layers that only lost adapters: those adapters are gated to 0 on the layer (no allocation);
- anything else: the layer's old contribution is undone and the new one applied."""

from __future__ import annotations

import os
import time

from .mechanisms.choose import plan_work
from .mechanisms.merge import MergedModule, merge_module
from .mechanisms.runtime import RuntimePath
from .plan.resolve import Plan, PlannedPart
from .quant import backend_for
from .report import AppliedModule


def _has_quantized(p: Plan) -> bool:
    return any(backend_for(p.components.modules[pp.component].get_submodule(piece.module)) is not None
               for pp in p.planned for piece in pp.pieces)


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
        return (*self._where(pp), pp.part.stem, pp.part.family, pp.scale)

    def keys(self, contribs: list) -> list[tuple]:
        hit = self._lists.get(id(contribs))
        if hit is not None and hit[0] is contribs:
            return hit[1]
        out = []
        for pp, piece in contribs:
            sources = getattr(pp.factors, "sources", None) if pp.part.family == "combined" else None
            if sources:  # a combined part is its sources and settings, strengths included (they change the result)
                inner = tuple(sorted((*self._part(s), p.src_start, p.dst_start, p.length, s.strength) for s, p in sources))
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
        return {id(pp): new_by_key[k] for k, (pp, _) in zip(self.keys(old_contribs), old_contribs, strict=True)
                if k in new_by_key}


def switch_runtime(sig: Signatures, path: RuntimePath, new_contribs: list) -> bool:
    """Re-point or gate an existing path; False when the layer must be rebuilt."""
    old_contribs = path.contributions
    new_keys = set(sig.keys(new_contribs))
    if not new_keys <= set(sig.keys(old_contribs)) or any(pp.part.family == "combined" for pp, _ in new_contribs):
        return False
    remap = sig.mapping(old_contribs, new_contribs)
    live = {pp.adapter.name for pp, _ in new_contribs}
    for pp, _ in old_contribs:
        if id(pp) not in remap and pp.adapter.name not in live:
            path.gates[pp.adapter.name] = 0.0
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
    record.contributions = [(remap.get(id(pp), pp), piece) for pp, piece in record.contributions]
    record.adapters = {pp.adapter.name for pp, _ in record.contributions}
    if [(pp.strength, pp.scale) for pp, _ in record.contributions] != before:
        record.write()
    return True


def switch(handle, adapters, strength: float = 1.0, stack: str = "sum", density: float | None = None) -> None:
    """Make `handle` represent a new adapter set on the same target, touching only layers that changed."""
    from . import api  # api imports this module lazily: no cycle at import time

    if not handle.active:
        raise RuntimeError("handle was removed")
    for rec in handle._merged:  # fused (undo='none') or a changed source file: refuse before anything changes
        rec.check_undo(rewrite=True)
    t0 = time.perf_counter()
    mode = handle.report.mode
    components = handle._plan.components
    api.validate_stack(stack, density)
    if handle._resolve_cache is None:
        from .plan.cache import ResolveCache

        handle._resolve_cache = ResolveCache(components)
    p, settings = api._resolve(components, adapters, strength, cache=handle._resolve_cache)
    if handle._grown or handle._quant or any(pp.grow for pp in p.planned) or _has_quantized(p):
        # Grown inputs change the model itself and quantized writes own their layers' storage: start over.
        handle.remove()
        fresh = api.apply(components, adapters, mode=mode, strength=strength, stack=stack, density=density,
                          **handle.quant_options, **handle.undo_options)
        handle.__dict__.update(fresh.__dict__)
        handle.last_switch = {"kept": 0, "reattached": 0, "rebuilt": len(handle.report.applied), "dropped": 0}
        return
    unmatched = list(p.unmatched)
    groups = api.combine_groups(api._group_by_module(p.planned), components.modules, stack, density)
    old_runtime = {id(rp.module): rp for rp in handle._runtime}
    detached = handle._detached
    sig = Signatures()

    def reuse(module, contribs) -> bool:
        rp = old_runtime.get(id(module))
        if rp is not None and set(sig.keys(contribs)) <= set(sig.keys(rp.contributions)):
            return True
        return (id(module), sig.structure(contribs)) in detached

    wp = plan_work(p, groups, mode, unmatched, reuse=reuse)
    work, prepared = wp.work, wp.prepared
    old_merged = {id(m.module): m for m in handle._merged}
    later = [m for m in handle._merged if not m.is_top()]
    if later:
        raise RuntimeError(f"{len(later)} merged layers were merged again by a later apply; remove that handle first")
    runtime: list[RuntimePath] = []
    merged: list[MergedModule] = []
    applied, counts = [], {"kept": 0, "reattached": 0, "rebuilt": 0, "dropped": 0}
    now_detached: dict[tuple[int, tuple], RuntimePath] = {}
    seen: set[int] = set()
    try:
        for comp, path, module, mechanism, why, contribs in work:
            seen.add(id(module))
            rp, rec = old_runtime.get(id(module)), old_merged.get(id(module))
            if rp is not None and mechanism == "runtime" and switch_runtime(sig, rp, contribs):
                runtime.append(rp)
                counts["kept"] += 1
            elif rec is not None and mechanism == "merge" and switch_merged(sig, rec, contribs):
                merged.append(rec)
                counts["kept"] += 1
            else:
                if rp is not None:
                    rp.detach()
                    now_detached[(id(module), sig.structure(rp.contributions))] = rp
                if rec is not None:
                    rec.restore()
                if mechanism == "merge":
                    merge_module(module, contribs, merged, handle.undo_with, (comp, path))
                    counts["rebuilt"] += 1
                else:
                    new = detached.get((id(module), sig.structure(contribs)))
                    if new is not None:  # back to a set this layer carried before: re-attach, nothing rebuilt
                        new.gates.clear()
                        new.rebind(sig.mapping(new.contributions, contribs))
                        counts["reattached"] += 1
                    else:
                        new = prepared.get((comp, path)) or RuntimePath(module, contribs)
                        counts["rebuilt"] += 1
                    runtime.append(new)
                    new.attach()
            entry = AppliedModule(comp, path, mechanism, sorted(api.adapter_names(contribs)),
                                  why if mode == "auto" else "", "", sorted({n for pp, _ in contribs for n in pp.notes}))
            if mechanism == "merge":
                merged[-1].entry = entry
                merged[-1]._report()
            applied.append(entry)
        for rp in handle._runtime:
            if id(rp.module) not in seen:
                rp.detach()
                now_detached[(id(rp.module), sig.structure(rp.contributions))] = rp
                counts["dropped"] += 1
        for rec in handle._merged:
            if id(rec.module) not in seen:
                rec.restore()
                counts["dropped"] += 1
    except BaseException:
        # Old and new layers are mixed at this point: leave the model clean (no adapters) rather than half-switched.
        for rp in (*runtime, *handle._runtime):
            rp.detach()
        for rec in reversed([*merged, *[m for m in handle._merged if m not in merged]]):
            rec.restore()
        handle.active = False
        raise
    handle._plan, handle._settings, handle._runtime, handle._merged = p, settings, runtime, merged
    handle._detached = now_detached
    handle.report = api._make_report(p, mode, applied, unmatched, t0)
    api.log.info("loraweave switch layers_kept=%d layers_reattached=%d layers_rebuilt=%d layers_dropped=%d %s",
                 counts["kept"], counts["reattached"], counts["rebuilt"], counts["dropped"], handle.report.summary())
    handle.last_switch = counts
