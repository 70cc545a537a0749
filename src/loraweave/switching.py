"""Switching a live handle to a new adapter set: only layers whose contributions changed are touched.

Per layer, a structure signature (which parts of which files land on which rows, stack settings) decides:
- unchanged structure: the runtime path or merge record is re-pointed at the new parts; strengths follow
  (runtime: a scale update; merge: rewritten from the backup only when a strength changed);
- runtime layers that only lost adapters: those adapters are gated to 0 on the layer (no allocation);
- anything else: the layer's old contribution is undone and the new one applied."""

from __future__ import annotations

import os

from .mechanisms.choose import plan_work
from .mechanisms.merge import MergedModule, merge_module
from .mechanisms.runtime import RuntimePath
from .plan.resolve import Plan, PlannedPart
from .quant import backend_for
from .report import AppliedModule


def _has_quantized(p: Plan) -> bool:
    return any(backend_for(p.components.modules[pp.component].get_submodule(piece.module)) is not None
               for pp in p.planned for piece in pp.pieces)


def part_identity(pp: PlannedPart) -> tuple:
    """What a part is, independent of strength: its file (path + size + mtime) or its tensors, and its stem."""
    adapter = pp.adapter
    if adapter.path:
        try:
            st = os.stat(adapter.path)
            where: tuple = (adapter.path, st.st_size, st.st_mtime_ns)
        except OSError:
            where = (adapter.path,)
    else:
        where = tuple(id(adapter.tensor(k)) for k in sorted(pp.part.keys))
    return (*where, pp.part.stem, pp.part.family, pp.scale)


def contribution_keys(contribs) -> list[tuple]:
    out = []
    for pp, piece in contribs:
        sources = getattr(pp.factors, "sources", None) if pp.part.family == "combined" else None
        if sources:  # a combined part is its sources and settings, strengths included (they change the result)
            inner = tuple(sorted((*part_identity(s), p.src_start, p.dst_start, p.length, s.strength) for s, p in sources))
            out.append(("combined", pp.factors.mode, pp.factors.density, inner))
        else:
            out.append((*part_identity(pp), piece.src_start, piece.dst_start, piece.length))
    return out


def structure(contribs) -> tuple:
    return tuple(sorted(contribution_keys(contribs), key=repr))


def mapping(old_contribs, new_contribs) -> dict[int, PlannedPart]:
    """id(old part) -> new part of the same identity, for re-pointing a path or merge record."""
    new_by_key = dict(zip(contribution_keys(new_contribs), (pp for pp, _ in new_contribs), strict=True))
    return {id(pp): new_by_key[k] for k, (pp, _) in zip(contribution_keys(old_contribs), old_contribs, strict=True)
            if k in new_by_key}


def switch_runtime(path: RuntimePath, old_contribs, new_contribs) -> bool:
    """Re-point or gate an existing path; False when the layer must be rebuilt."""
    old_keys, new_keys = set(contribution_keys(old_contribs)), set(contribution_keys(new_contribs))
    if not new_keys <= old_keys or any(pp.part.family == "combined" for pp, _ in new_contribs):
        return False
    kept = {id(pp) for k, (pp, _) in zip(contribution_keys(old_contribs), old_contribs, strict=True) if k in new_keys}
    path.rebind(mapping(old_contribs, new_contribs))
    live = {pp.adapter.name for pp, _ in new_contribs}
    for pp, _ in old_contribs:
        if id(pp) not in kept and pp.adapter.name not in live:
            path.gates[pp.adapter.name] = 0.0
    for name in live:
        path.gates.pop(name, None)
    path.refresh_scales()
    return True


def switch_merged(record: MergedModule, old_contribs, new_contribs) -> bool:
    """Same structure: re-point and rewrite only if a strength changed; False when it must be redone."""
    if structure(old_contribs) != structure(new_contribs):
        return False
    remap = mapping(old_contribs, new_contribs)
    before = [(pp.strength, pp.scale) for pp, _ in record.contributions]
    record.contributions = [(remap.get(id(pp), pp), piece) for pp, piece in record.contributions]
    record.adapters = {pp.adapter.name for pp, _ in record.contributions}
    if [(pp.strength, pp.scale) for pp, _ in record.contributions] != before:
        record.write()
    return True


def redo_merged(module, record: MergedModule | None, new_contribs, records: list[MergedModule]) -> MergedModule | None:
    """Undo a layer's old merge (if any) and merge the new contributions (if any)."""
    if record is not None:
        record.restore()
    if not new_contribs:
        return None
    merge_module(module, new_contribs, records)
    return records[-1]


def switch(handle, adapters, strength: float = 1.0, stack: str = "sum", density: float | None = None) -> None:
    """Make `handle` represent a new adapter set on the same target, touching only layers that changed."""
    from . import api  # api imports this module lazily: no cycle at import time

    if not handle.active:
        raise RuntimeError("handle was removed")
    mode = handle.report.mode
    components = handle._plan.components
    api.validate_stack(stack, density)
    if getattr(handle, "_resolve_cache", None) is None:
        from .plan.cache import ResolveCache

        handle._resolve_cache = ResolveCache(components)
    p, settings = api._resolve(components, adapters, strength, cache=handle._resolve_cache)
    quant_options = getattr(handle, "quant_options", {})
    if handle._grown or handle._quant or any(pp.grow for pp in p.planned) or _has_quantized(p):
        # Grown inputs change the model itself and quantized writes own their layers' storage: start over.
        handle.remove()
        fresh = api.apply(components, adapters, mode=mode, strength=strength, stack=stack, density=density,
                          **quant_options)
        handle.__dict__.update(fresh.__dict__)
        handle.last_switch = {"kept": 0, "reattached": 0, "rebuilt": len(handle.report.applied), "dropped": 0}
        return
    unmatched = list(p.unmatched)
    groups = api.combine_groups(api._group_by_module(p.planned), components.modules, stack, density)
    old_runtime = {id(rp.module): rp for rp in handle._runtime}
    detached = getattr(handle, "_detached", {})  # paths the previous switch took off, by (module, structure)

    def reuse(module, contribs) -> bool:
        rp = old_runtime.get(id(module))
        keys = set(contribution_keys(contribs))
        if rp is not None and keys <= set(contribution_keys(rp.contributions)):
            return True
        return (id(module), structure(contribs)) in detached

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
            if rp is not None and mechanism == "runtime" and switch_runtime(rp, rp.contributions, contribs):
                runtime.append(rp)
                counts["kept"] += 1
            elif rec is not None and mechanism == "merge" and switch_merged(rec, rec.contributions, contribs):
                merged.append(rec)
                counts["kept"] += 1
            else:
                if rp is not None:
                    rp.detach()
                if rec is not None:
                    rec.restore()
                if rp is not None:
                    now_detached[(id(module), structure(rp.contributions))] = rp
                if mechanism == "merge":
                    merge_module(module, contribs, merged)
                    counts["rebuilt"] += 1
                else:
                    new = detached.get((id(module), structure(contribs)))
                    if new is not None:  # back to a set this layer carried before: re-attach, nothing rebuilt
                        new.rebind(mapping(new.contributions, contribs))
                        new.gates.clear()
                        new.refresh_scales()
                        counts["reattached"] += 1
                    else:
                        new = prepared.get((comp, path)) or RuntimePath(module, contribs)
                        counts["rebuilt"] += 1
                    runtime.append(new)
                    new.attach()
            applied.append(AppliedModule(comp, path, mechanism, sorted(api.adapter_names(contribs)),
                                             why if mode == "auto" else "", "",
                                             sorted({n for pp, _ in contribs for n in pp.notes})))
        for rp in handle._runtime:
            if id(rp.module) not in seen:
                rp.detach()
                now_detached[(id(rp.module), structure(rp.contributions))] = rp
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
    handle.report = api._make_report(p, mode, applied, unmatched, 0.0)
    handle.report.seconds = 0.0
    api.log.info("loraweave switch layers_kept=%d layers_reattached=%d layers_rebuilt=%d layers_dropped=%d %s",
                 counts["kept"], counts["reattached"], counts["rebuilt"], counts["dropped"], handle.report.summary())
    handle.last_switch = counts
