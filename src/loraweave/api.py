"""Public entry points: `plan` (resolve and report, touch nothing) and `apply` (merge / runtime / auto)."""

from __future__ import annotations

import copy
import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping

import torch
from tqdm.auto import tqdm

from .errors import StrictApplyError
from .families.base import PartRejected
from .formats.adapter import Adapter, load_adapter
from .mechanisms.merge import Contribution, MergedModule, merge_blocker, merge_module, needs_bias
from .mechanisms.quantized import QuantWrite, Route, factorable_reason, route_hook_free
from .mechanisms.runtime import RuntimePath, runtime_blocker
from .plan.resolve import Plan, PlannedPart, resolve
from .plan.target import as_components
from .quant import QuantBackend, backend_for, broken
from .report import AppliedModule, Report

log = logging.getLogger("loraweave")
MODES = ("auto", "merge", "runtime")
QUANTIZED = ("auto", "host", "requantize")
AdapterSpec = str | os.PathLike | Adapter | Mapping | tuple


def _normalise_adapters(adapters, strength: float) -> list[tuple[Adapter, float]]:
    if isinstance(adapters, (str, os.PathLike, Adapter, Mapping)) or (
        isinstance(adapters, tuple) and len(adapters) == 2 and isinstance(adapters[1], (int, float))
    ):
        adapters = [adapters]
    out: list[tuple[Adapter, float]] = []
    seen: Counter = Counter()
    for item in adapters:
        own = 1.0
        if isinstance(item, tuple):
            item, own = item
        # A shallow copy per use: the caller's object is never renamed, and one Adapter may be passed twice.
        adapter = copy.copy(load_adapter(item))
        seen[adapter.name] += 1
        if seen[adapter.name] > 1:  # two adapters must not share a name: set_strength addresses them by it
            adapter.name = f"{adapter.name}#{seen[adapter.name]}"
        out.append((adapter, _finite_strength(float(own) * float(strength))))
    return out


def _finite_strength(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"strength must be a finite number, got {value}")
    return value


def _adapter_summaries(plan: Plan) -> list[dict]:
    out = []
    for adapter in plan.adapters:
        planned = [pp for pp in plan.planned if pp.adapter is adapter]
        out.append(
            {
                "name": adapter.name,
                "path": adapter.path,
                "layout": adapter.layout,
                "families": adapter.families,
                "alpha_sources": dict(Counter(pp.alpha_source for pp in planned)),
                "strength": plan.strengths[adapter.name],
                "keys_total": adapter.keys_total,
                "keys_applied": sum(len(pp.part.keys) for pp in planned),
            }
        )
    return out


def _group_by_module(planned: list[PlannedPart]) -> dict[tuple[str, str], list[Contribution]]:
    groups: dict[tuple[str, str], list[Contribution]] = {}
    for pp in planned:
        for piece in pp.pieces:
            groups.setdefault((pp.component, piece.module), []).append((pp, piece))
    return groups


def _make_report(plan: Plan, mode: str, applied: list[AppliedModule], unmatched: list[dict], t0: float) -> Report:
    report = Report(mode=mode, adapters=_adapter_summaries(plan), applied=applied, unmatched=unmatched)
    report.keys_total = sum(a.keys_total for a in plan.adapters)
    report.keys_applied = sum(a["keys_applied"] for a in report.adapters)
    report.seconds = time.perf_counter() - t0
    return report


def plan(target, adapters: Iterable[AdapterSpec] | AdapterSpec, strength: float = 1.0) -> Report:
    """Resolve every key against `target` and report where it would land; nothing is modified.

    Works on models built on the `meta` device (no weights needed)."""
    t0 = time.perf_counter()
    p = resolve(as_components(target), _normalise_adapters(adapters, strength))
    applied = [
        AppliedModule(comp, path, "planned", sorted({pp.adapter.name for pp, _ in contribs}),
                      notes=sorted({n for pp, _ in contribs for n in pp.notes}))
        for (comp, path), contribs in _group_by_module(p.planned).items()
    ]
    report = _make_report(p, "plan", applied, list(p.unmatched), t0)
    report.log()
    return report


def _choose(mode: str, module: torch.nn.Module, contribs: list[Contribution]) -> tuple[str | None, str]:
    """(mechanism or None, why)."""
    merge_no = merge_blocker(module, needs_bias(contribs))
    runtime_no = runtime_blocker(module)
    if mode == "merge":
        return (None, f"cannot merge: {merge_no}; use mode='runtime' or 'auto'") if merge_no else ("merge", "")
    if mode == "runtime":
        return (None, f"cannot run at runtime: {runtime_no}; use mode='merge' or 'auto'") if runtime_no else ("runtime", "")
    if merge_no is None:
        return "merge", "plain floating weight"
    if runtime_no is None:
        return "runtime", merge_no
    return None, f"neither mechanism fits: {merge_no}; {runtime_no}"


def _check_runtime(
    mode: str, module: torch.nn.Module, contribs: list[Contribution], why: str, quantized: bool = False
) -> tuple[str | None, str, RuntimePath | None]:
    """Build the runtime path without attaching it: a family may refuse (e.g. DoRA on a quantized weight)."""
    try:
        path = RuntimePath(module, contribs)
    except PartRejected as rejected:
        # Never fall back to a plain merge on a quantized layer: its storage is not the weight (fp8 looks float).
        if mode == "auto" and not quantized and merge_blocker(module, needs_bias(contribs)) is None:
            return "merge", f"runtime refused: {rejected}", None
        return None, f"cannot run at runtime: {rejected}", None
    return "runtime", why, path


def _choose_quantized(
    mode: str, quantized: str, backend: QuantBackend, module: torch.nn.Module, contribs: list[Contribution],
    host_rank: int, cache=None, layer: str = "",
) -> tuple[str | None, str, Route | None]:
    """(mechanism or None, why, routing result) for a layer a quantization backend owns."""
    runtime_no = runtime_blocker(module)
    if mode == "runtime":
        return (None, f"cannot run at runtime: {runtime_no}", None) if runtime_no else ("runtime", "", None)
    missing = backend.unavailable()
    if mode == "merge" or (mode == "auto" and quantized in ("host", "requantize")):
        if missing:
            route = Route(None, f"{backend.name} cannot run here: {missing}")
        else:
            route = route_hook_free(backend, module, contribs, host_rank, force_requantize=quantized == "requantize",
                                    cache=cache, layer=layer)
        if route.mechanism is not None or mode == "merge":
            return route.mechanism, route.why if route.mechanism else f"cannot merge: {route.why}", route
        if runtime_no is None:
            return "runtime", f"hook-free path declined: {route.why}", None
        return None, f"neither mechanism fits: {route.why}; {runtime_no}", None
    caps = None if missing else backend.capabilities(module)
    not_factorable = factorable_reason(module, contribs) or ("bias delta" if needs_bias(contribs) else None)
    if caps is not None and caps.factor_channel and not_factorable is None:
        return "factor", f"{backend.name} side channel, exact", Route("factor", "")
    why = f"{backend.name}: " + (missing or (not_factorable if caps.factor_channel else caps.reason or "no side channel"))
    return ("runtime", why, None) if runtime_no is None else (None, f"neither mechanism fits: {why}; {runtime_no}", None)


class Handle:
    """What `apply` did; `remove()` undoes it exactly. Usable as a context manager."""

    def __init__(self, plan: Plan, report: Report, merged: list[MergedModule], runtime: list[RuntimePath],
                 quant: list[QuantWrite] | None = None) -> None:
        self._plan = plan
        self.report = report
        self._merged = merged
        self._runtime = runtime
        self._quant = quant or []
        self.active = True

    def remove(self) -> None:
        """Restore merged weights bit-exactly and detach runtime paths. Idempotent."""
        if not self.active:
            return
        later = [m for m in [*self._merged, *self._quant] if not m.is_top()]
        if later:
            raise RuntimeError(
                f"{len(later)} merged layers were merged again by a later apply; remove that handle first "
                "(merges undo exactly only in reverse order)"
            )
        for path in self._runtime:
            path.detach()
        for write in reversed(self._quant):
            write.restore()
        for merged in reversed(self._merged):
            merged.restore()
        self.active = False

    def set_strength(self, name: str, value: float) -> None:
        """Change one adapter's strength. Runtime: a scale update only. Merge: rewritten from the backup."""
        if name not in self._plan.strengths:
            raise KeyError(f"no adapter named {name!r}; have {sorted(self._plan.strengths)}")
        if not self.active:
            raise RuntimeError("handle was removed")
        if any(name in m.adapters and not m.is_top() for m in [*self._merged, *self._quant]):
            raise RuntimeError("a later apply merged into the same layers; remove it before changing this strength")
        value = _finite_strength(float(value))
        self._plan.strengths[name] = value
        for pp in self._plan.planned:
            if pp.adapter.name == name:
                pp.strength = float(value)
        for path in self._runtime:
            if name in path.adapters:
                path.refresh_scales()
        for merged in self._merged:
            if name in merged.adapters:
                merged.write()
        for write in self._quant:
            if name in write.adapters:  # rewritten from the layer's original tensors: nothing compounds
                write.write()
                if write.entry is not None:
                    write.entry.retention, write.entry.capture, write.entry.rank = write.retention, write.capture, write.rank
        for summary in self.report.adapters:
            if summary["name"] == name:
                summary["strength"] = float(value)

    @property
    def strengths(self) -> dict[str, float]:
        return dict(self._plan.strengths)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Handle(active={self.active}, {self.report.summary()})"


def apply(
    target,
    adapters: Iterable[AdapterSpec] | AdapterSpec,
    mode: str = "auto",
    strength: float = 1.0,
    strict: bool = False,
    progress: bool | None = None,
    quantized: str = "auto",
    host_rank: int = 256,
    cache=None,
) -> Handle:
    """Apply adapters to `target` (module, mapping of components, or diffusers pipeline).

    mode: "merge" (into the weights, undoable), "runtime" (forward hooks, weights untouched), or "auto"
    (runtime where merging would be lossy or impossible: quantized, offloaded; merge elsewhere).
    All-or-nothing: if anything raises midway, the model is left exactly as it was.

    Quantized layers (SDNQ, bitsandbytes, torchao, optimum-quanto, GGUF; see `loraweave.quant`):
    - mode="auto": a plain-LoRA set rides the layer's low-rank side channel exactly ("factor": SDNQ svd_up/down,
      no hook, no backup); anything else gets a runtime path beside the layer's own forward.
    - mode="runtime": always the runtime path (exact for every family and backend; storage untouched).
    - mode="merge": hook-free. Plain LoRA -> factor channel; otherwise int8-and-wider layers are requantized
      (dequantize, add, requantize with the layer's own config) and sub-8-bit layers follow the routing rule:
      requantize only if rms(ΔW)/grid step > 0.30 and hosting would capture < 0.90 of ΔW, else "hosted".
    quantized: "auto" (above), "host" (opt-in: in mode="auto", non-plain-LoRA sets take the hook-free route of
      mode="merge" instead of a hook, for compiled or hook-free deployments), or "requantize" (every hook-free
      layer is requantized, even plain LoRA; for measurements).
    host_rank: rank cap of a hosted truncation (randomized SVD, seeded locally: the caller's RNG is untouched);
      0 disables hosting. The report gives the retention ρ and captured energy of hosted and requantized layers.
    cache: a `loraweave.mechanisms.factor_cache.FactorCache` (or a directory for one) that keeps hosted factors
      on disk; a replay is bit-identical to a fresh compute."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if quantized not in QUANTIZED:
        raise ValueError(f"quantized must be one of {QUANTIZED}, got {quantized!r}")
    if not isinstance(host_rank, int) or host_rank < 0:
        raise ValueError(f"host_rank must be an int >= 0, got {host_rank!r}")
    if cache is not None and not hasattr(cache, "load"):
        from .mechanisms.factor_cache import FactorCache

        cache = FactorCache(cache)
    t0 = time.perf_counter()
    p = resolve(as_components(target), _normalise_adapters(adapters, strength))
    unmatched = list(p.unmatched)
    groups = _group_by_module(p.planned)
    work: list[tuple[str, str, torch.nn.Module, str, str, list[Contribution]]] = []
    rejected_parts: dict[int, str] = {}
    prepared: dict[tuple[str, str], RuntimePath] = {}  # built while checking, attached below unless parts drop out
    routes: dict[tuple[str, str], tuple[QuantBackend, Route | None]] = {}
    for (comp, path), contribs in groups.items():
        module = p.components.modules[comp].get_submodule(path)
        backend = backend_for(module)
        if backend is not None:
            mechanism, why, route = _choose_quantized(mode, quantized, backend, module, contribs, host_rank,
                                                      cache, f"{comp}.{path}")
            routes[(comp, path)] = (backend, route)
        else:
            mechanism, why = _choose(mode, module, contribs)
        if mechanism == "runtime":
            mechanism, why, runtime_path = _check_runtime(mode, module, contribs, why, quantized=backend is not None)
            if runtime_path is not None:
                prepared[(comp, path)] = runtime_path
        if mechanism is None:
            for pp, _ in contribs:
                rejected_parts.setdefault(id(pp), f"{why} ({comp}.{path})")
        work.append((comp, path, module, mechanism, why, contribs))
    if rejected_parts:
        # A part split over several modules lands everywhere or nowhere: never half-applied.
        for pp in p.planned:
            if id(pp) in rejected_parts:
                unmatched += [{"adapter": pp.adapter.name, "key": k, "reason": rejected_parts[id(pp)]} for k in pp.part.keys]
        p.planned = [pp for pp in p.planned if id(pp) not in rejected_parts]
        kept = []
        for c, path, m, mech, why, contribs in work:
            remaining = [(pp, pc) for pp, pc in contribs if id(pp) not in rejected_parts]
            if len(remaining) != len(contribs):
                prepared.pop((c, path), None)  # its contributions changed: build it again below
                if (c, path) in routes:
                    routes[(c, path)] = (routes[(c, path)][0], None)  # routed on other contributions
            if remaining:
                kept.append((c, path, m, mech, why, remaining))
        work = kept
    if strict and unmatched:
        report = _make_report(p, mode, [], unmatched, t0)
        raise StrictApplyError(f"strict: {len(unmatched)} keys did not land ({report.reasons()})", report)
    merged: list[MergedModule] = []
    runtime: list[RuntimePath] = []
    quant: list[QuantWrite] = []
    applied: list[AppliedModule] = []
    show = progress if progress is not None else (len(work) > 200 and sys.stderr.isatty())
    try:
        for comp, path, module, mechanism, why, contribs in tqdm(work, desc="loraweave", disable=not show, unit="layer"):
            cost = ""
            backend = routes.get((comp, path), (None, None))[0]
            write = None
            if mechanism == "merge":
                merge_module(module, contribs, merged)
            elif mechanism == "runtime":
                rp = prepared.get((comp, path)) or RuntimePath(module, contribs)
                runtime.append(rp)  # recorded before the hook exists, so an interrupt cannot leave it behind
                rp.attach()
                cost = "; ".join(sorted(rp.costs))
            else:
                write = QuantWrite(module, backend, contribs, mechanism, host_rank=host_rank,
                                   cache=cache if mechanism == "hosted" else None, layer=f"{comp}.{path}")
                quant.append(write)  # recorded before the layer is touched: rollback finds it
                write.apply(routes[(comp, path)][1])
            names = sorted({pp.adapter.name for pp, _ in contribs})
            notes = sorted({n for pp, _ in contribs for n in pp.notes})
            show_why = why if mode == "auto" or write is not None else ""
            entry = AppliedModule(comp, path, mechanism, names, show_why, cost, notes,
                                  backend=backend.name if backend is not None else "")
            if write is not None:
                entry.retention, entry.capture, entry.rank = write.retention, write.capture, write.rank
                entry.cache_hit, write.entry = write.cache_hit, entry
            applied.append(entry)
    except BaseException:
        for rp in runtime:
            rp.detach()
        for w in reversed(quant):
            w.restore()
        for m in reversed(merged):
            m.restore()
        log.warning("loraweave apply failed midway; model restored to its state before the call")
        raise
    report = _make_report(p, mode, applied, unmatched, t0)
    if routes:  # the backends this model uses (probing others would cost time for nothing) and broken imports
        used = {b.name: b for b, _ in routes.values()}
        report.backends_unavailable = {n: why for n, why in broken().items()}
        report.backends_unavailable |= {n: why for n, b in used.items() if (why := b.unavailable())}
    report.log()
    return Handle(p, report, merged, runtime, quant)
