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
from .mechanisms.grow import GrownInput, grow_input
from .mechanisms.merge import Contribution, MergedModule, merge_blocker, merge_module, needs_bias
from .mechanisms.runtime import RuntimePath, runtime_blocker
from .plan.resolve import Plan, PlannedPart, resolve
from .plan.stacking import adapter_names, combine_groups
from .plan.target import as_components
from .plan.weights import AdapterWeights, assign, part_strength
from .report import AppliedModule, Report
from .spec import AdapterSpec
from .stack.combine import SELECT_MODES, validate_stack

log = logging.getLogger("loraweave")
MODES = ("auto", "merge", "runtime")
AdapterSource = str | os.PathLike | Adapter | Mapping | tuple | AdapterSpec


def _specs(adapters, strength: float) -> list[tuple[AdapterSpec, AdapterWeights]]:
    if isinstance(adapters, (str, os.PathLike, Adapter, Mapping, AdapterSpec)) or (
        isinstance(adapters, tuple) and len(adapters) == 2 and isinstance(adapters[1], (int, float))
    ):
        adapters = [adapters]
    out = []
    for item in adapters:
        if isinstance(item, tuple):
            item = AdapterSpec(item[0], item[1])
        spec = item if isinstance(item, AdapterSpec) else AdapterSpec(item)
        te = None if spec.te_strength is None else _finite_strength(float(spec.te_strength) * float(strength))
        out.append((spec, AdapterWeights(_finite_strength(float(spec.strength) * float(strength)), te, spec.block_weights)))
    return out


def _normalise_adapters(specs: list[tuple[AdapterSpec, AdapterWeights]], load=load_adapter) -> list[tuple[Adapter, AdapterWeights]]:
    out: list[tuple[Adapter, AdapterWeights]] = []
    seen: Counter = Counter()
    for spec, weights in specs:
        # A shallow copy per use: the caller's object is never renamed, and one Adapter may be passed twice.
        adapter = copy.copy(load(spec.source))
        if spec.name:
            adapter.name = spec.name
        seen[adapter.name] += 1
        if seen[adapter.name] > 1:  # two adapters must not share a name: set_strength addresses them by it
            adapter.name = f"{adapter.name}#{seen[adapter.name]}"
        out.append((adapter, weights))
    return out


def _resolve(target, adapters, strength: float, cache=None) -> tuple[Plan, dict[str, AdapterWeights]]:
    """Plan with per-part strengths; `cache` (a ResolveCache) reuses loads and resolutions of sources seen before."""
    specs = _specs(adapters, strength)
    items = _normalise_adapters(specs, cache.load if cache is not None else load_adapter)
    if cache is not None:
        p = cache.resolve([(a, w.strength) for a, w in items], [s.source for s, _ in specs])
    else:
        p = resolve(as_components(target), [(a, w.strength) for a, w in items])
    settings = {a.name: w for a, w in items}
    assign(p, settings)
    return p, settings


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
    p, _ = _resolve(target, adapters, strength)
    applied = [
        AppliedModule(comp, path, "planned", sorted(adapter_names(contribs)),
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
    mode: str, module: torch.nn.Module, contribs: list[Contribution], why: str
) -> tuple[str | None, str, RuntimePath | None]:
    """Build the runtime path without attaching it: a family may refuse (e.g. DoRA on a quantized weight)."""
    try:
        path = RuntimePath(module, contribs)
    except PartRejected as rejected:
        if mode == "auto" and merge_blocker(module, needs_bias(contribs)) is None:
            return "merge", f"runtime refused: {rejected}", None
        return None, f"cannot run at runtime: {rejected}", None
    return "runtime", why, path


Work = list[tuple[str, str, torch.nn.Module, str, str, list[Contribution]]]


def _plan_work(p: Plan, groups, mode: str, unmatched: list[dict],
               reuse=None) -> tuple[Work, dict[tuple[str, str], RuntimePath]]:
    """Choose a mechanism per layer; parts some layer refuses are dropped everywhere and added to `unmatched`.

    reuse(module, contribs) -> True: a live runtime path will serve these contributions (switching): not rebuilt."""
    work: Work = []
    rejected_parts: dict[int, str] = {}
    prepared: dict[tuple[str, str], RuntimePath] = {}  # built while checking, attached later unless parts drop out
    for (comp, path), contribs in groups.items():
        module = p.components.modules[comp].get_submodule(path)
        mechanism, why = _choose(mode, module, contribs)
        if mechanism == "runtime" and not (reuse is not None and reuse(module, contribs)):
            mechanism, why, runtime_path = _check_runtime(mode, module, contribs, why)
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
                prepared.pop((c, path), None)  # its contributions changed: build it again
            if remaining:
                kept.append((c, path, m, mech, why, remaining))
        work = kept
    return work, prepared


def _growth(p: Plan) -> list[tuple[str, str, int, str]]:
    """(component, module, width, config key) of every input a planned control adapter grows, once each."""
    found: dict[tuple[str, str], tuple[int, str]] = {}
    for pp in p.planned:
        for module, (width, key) in pp.grow.items():
            prev = found.get((pp.component, module))
            if prev is not None and prev[0] != width:
                raise ValueError(f"adapters ask {pp.component}.{module} to grow to {prev[0]} and {width} columns")
            found[(pp.component, module)] = (width, key)
    return [(c, m, w, k) for (c, m), (w, k) in found.items()]


class Handle:
    """What `apply` did; `remove()` undoes it exactly. Usable as a context manager."""

    def __init__(self, plan: Plan, report: Report, merged: list[MergedModule], runtime: list[RuntimePath],
                 settings: dict[str, AdapterWeights] | None = None, grown: list[GrownInput] | None = None) -> None:
        self._plan = plan
        self.report = report
        self._merged = merged
        self._runtime = runtime
        self._settings = settings or {name: AdapterWeights(s) for name, s in plan.strengths.items()}
        self._grown = grown or []
        self._select: tuple[str, tuple[str, str]] | None = None  # (mode, (subject, style)) for select modes
        self.active = True

    def remove(self) -> None:
        """Restore merged weights bit-exactly and detach runtime paths. Idempotent."""
        if not self.active:
            return
        later = [m for m in self._merged if not m.is_top()]
        if later:
            raise RuntimeError(
                f"{len(later)} merged layers were merged again by a later apply; remove that handle first "
                "(merges undo exactly only in reverse order)"
            )
        for path in self._runtime:
            path.detach()
        for merged in reversed(self._merged):
            merged.restore()
        for grown in reversed(self._grown):
            grown.restore()
        self.active = False

    def set_strength(self, name: str, value: float, te: float | None = None) -> None:
        """Change one adapter's strength (and, with `te`, its text-encoder strength; else text encoders keep
        theirs when it was set apart, or follow). Runtime: a scale update only. Merge: rewritten from the backup.
        Block weights stay."""
        if name not in self._plan.strengths:
            raise KeyError(f"no adapter named {name!r}; have {sorted(self._plan.strengths)}")
        if not self.active:
            raise RuntimeError("handle was removed")
        if any(name in m.adapters and not m.is_top() for m in self._merged):
            raise RuntimeError("a later apply merged into the same layers; remove it before changing this strength")
        value = _finite_strength(float(value))
        self._plan.strengths[name] = value
        self._settings[name].strength = value
        if te is not None:
            self._settings[name].te_strength = _finite_strength(float(te))
        for pp in self._plan.planned:
            if pp.adapter.name == name:
                pp.strength = part_strength(pp, self._settings[name])
        for path in self._runtime:
            if name in path.adapters:
                path.refresh_scales()
        for merged in self._merged:
            if name in merged.adapters:
                merged.write()
        for summary in self.report.adapters:
            if summary["name"] == name:
                summary["strength"] = float(value)

    def select_schedule(self, total_steps: int, **kwargs: float):
        """For stack="klora"/"estlora": the per-layer subject->style schedule over `total_steps` sampling steps.

        Use: `s = handle.select_schedule(steps); s.prime(handle)`, then pass
        `callback_on_step_end=s.diffusers_callback(handle)` to the diffusers pipeline call."""
        if self._select is None:
            raise RuntimeError("select_schedule needs apply(..., stack='klora' or 'estlora')")
        from .mechanisms.select import build_schedule

        return build_schedule(self._select[0], self._runtime_by_key(), self._select[1], total_steps, **kwargs)

    def set_layer_choice(self, layer_key: str, index: int) -> None:
        """Select modes: run the subject (0) or the style (1) adapter on one layer from now on."""
        from .mechanisms.select import choose

        if self._select is None:
            raise RuntimeError("set_layer_choice needs apply(..., stack='klora' or 'estlora')")
        paths = self._runtime_by_key()
        if layer_key not in paths:
            raise KeyError(f"no runtime layer {layer_key!r}")
        choose(paths[layer_key], self._select[1], index)

    def _runtime_by_key(self) -> dict[str, RuntimePath]:
        modules = {id(m): f"{c}.{n}" for c, root in self._plan.components for n, m in root.named_modules()}
        return {modules[id(rp.module)]: rp for rp in self._runtime}

    def switch(self, adapters, strength: float = 1.0, stack: str = "sum", density: float | None = None) -> None:
        """Replace the applied set with a new one, touching only layers whose contributions changed.

        Same structure on a layer: re-pointed (runtime: scale update; merge: rewritten only if a strength
        changed). Runtime layers that only lose adapters gate them to 0 (no allocation). `last_switch` counts
        kept / rebuilt / dropped layers. If it fails midway, every adapter is removed and the error raised."""
        from .switching import switch

        switch(self, adapters, strength, stack, density)

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
    stack: str = "sum",
    density: float | None = None,
) -> Handle:
    """Apply adapters to `target` (module, mapping of components, or diffusers pipeline).

    mode: "merge" (into the weights, undoable), "runtime" (forward hooks, weights untouched), or "auto"
    (runtime where merging would be lossy or impossible: quantized, offloaded; merge elsewhere).
    stack: how adapters sharing a layer combine: "sum" (exact), "ties", "dare_ties", "dare_linear",
    "magnitude_prune" (with `density` in (0, 1]); DARE masks are deterministic per layer, adapters and settings.
    Items of `adapters` may be `AdapterSpec`s (strength, text-encoder strength, block weights, name).
    All-or-nothing: if anything raises midway, the model is left exactly as it was."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    validate_stack(stack, density)
    t0 = time.perf_counter()
    p, settings = _resolve(target, adapters, strength)
    select = stack in SELECT_MODES
    if select:
        validate_stack(stack, density, len(p.adapters))
        if mode == "merge":
            raise ValueError(f"stack={stack!r} switches layers between adapters per step: use mode='runtime'")
        mode = "runtime"
    unmatched = list(p.unmatched)
    groups = combine_groups(_group_by_module(p.planned), p.components.modules, stack, density)
    work, prepared = _plan_work(p, groups, mode, unmatched)
    if strict and unmatched:
        report = _make_report(p, mode, [], unmatched, t0)
        raise StrictApplyError(f"strict: {len(unmatched)} keys did not land ({report.reasons()})", report)
    merged: list[MergedModule] = []
    runtime: list[RuntimePath] = []
    applied: list[AppliedModule] = []
    grown: list[GrownInput] = []
    show = progress if progress is not None else (len(work) > 200 and sys.stderr.isatty())
    try:
        for comp, path, width, key in _growth(p):  # control adapters: the wider input exists before they land
            grown.append(grow_input(p.components.modules[comp], path, width, key))
        for comp, path, module, mechanism, why, contribs in tqdm(work, desc="loraweave", disable=not show, unit="layer"):
            cost = ""
            if mechanism == "merge":
                merge_module(module, contribs, merged)
            else:
                rp = prepared.get((comp, path)) or RuntimePath(module, contribs)
                runtime.append(rp)  # recorded before the hook exists, so an interrupt cannot leave it behind
                rp.attach()
                cost = "; ".join(sorted(rp.costs))
            names = sorted(adapter_names(contribs))
            notes = sorted({n for pp, _ in contribs for n in pp.notes})
            applied.append(AppliedModule(comp, path, mechanism, names, why if mode == "auto" else "", cost, notes))
    except BaseException:
        for rp in runtime:
            rp.detach()
        for m in reversed(merged):
            m.restore()
        for g in reversed(grown):
            g.restore()
        log.warning("loraweave apply failed midway; model restored to its state before the call")
        raise
    report = _make_report(p, mode, applied, unmatched, t0)
    report.log()
    handle = Handle(p, report, merged, runtime, settings, grown)
    if select:  # every shared layer starts on the subject (step 0 of any schedule)
        handle._select = (stack, (p.adapters[0].name, p.adapters[1].name))
        from .mechanisms.select import choose, shared_layers

        for rp in shared_layers(handle._runtime_by_key(), handle._select[1]).values():
            choose(rp, handle._select[1], 0)
    return handle
