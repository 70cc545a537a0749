"""The machinery `apply` and `switch` share: options checked once, adapter sets resolved, layers installed
into a journal, reports built. Imports neither api nor handle (they sit on top of it)."""

from __future__ import annotations

import copy
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import torch

from ..errors import ArgumentError, NonFiniteResultError
from ..formats.adapter import Adapter, load_adapter
from ..mechanisms.choose import LayerWork, WorkPlan, plan_work
from ..mechanisms.merge.grow import grow_input
from ..mechanisms.merge.layer import MergedModule, merge_module
from ..mechanisms.merge.params import apply_params
from ..mechanisms.merge.undo import reused_buffers
from ..mechanisms.quantized.write import QuantWrite
from ..mechanisms.runtime.compiled import prepare
from ..mechanisms.runtime.path import RuntimePath
from ..modes import ApplyMode
from ..progress import PROGRESS_LAYERS, bar, on_terminal
from ..quant import broken
from ..quant.backend import QuantBackend
from ..report.miss import Skipped, Unmatched
from ..report.report import AppliedModule, Report
from ..request.adapters import as_specs, check_names
from ..request.spec import AdapterSpec, finite_strength
from ..resolve.params import PlannedParam
from ..resolve.planner import Plan, PlannedPart, resolve
from ..resolve.schedule import step_window
from ..resolve.stacking import Contribution, adapter_names, combine_groups
from ..resolve.target import as_components, experts
from ..resolve.weights import AdapterWeights, assign
from .interrupts import interrupts_held
from .journal import Journal
from .options import Options

if TYPE_CHECKING:
    from ..arch.aliases import AliasTable
    from ..resolve.cache import ResolveCache, Source

# What `adapters` may hold: a path, an Adapter, a state dict, (source, strength) or an AdapterSpec.
AdapterSource = (
    str | os.PathLike[str] | Adapter | Mapping[str, torch.Tensor] | tuple[object, float] | AdapterSpec
)
AdapterSet = Iterable[AdapterSource] | AdapterSource  # one source or several
# A runtime path to re-use for a layer instead of building one (switching), or None.
PathFor = Callable[[torch.nn.Module, list[Contribution]], RuntimePath | None]


def _specs(adapters: AdapterSet, strength: float) -> list[tuple[AdapterSpec, AdapterWeights]]:
    strength = finite_strength(strength)
    out: list[tuple[AdapterSpec, AdapterWeights]] = []
    for spec in as_specs(adapters):
        te = None if spec.te_strength is None else finite_strength(float(spec.te_strength) * float(strength))
        window = step_window(spec.steps, spec.ramp, spec.ramp_strengths, float(strength))
        out.append(
            (
                spec,
                AdapterWeights(
                    finite_strength(float(spec.strength) * float(strength)),
                    te,
                    spec.block_weights,
                    spec.component_strengths,
                    window,
                    spec.modality_strengths,
                ),
            )
        )
    return out


def _normalise_adapters(
    specs: list[tuple[AdapterSpec, AdapterWeights]], load: Callable[[Source], Adapter] = load_adapter
) -> list[tuple[Adapter, AdapterWeights]]:
    out: list[tuple[Adapter, AdapterWeights]] = []
    seen: Counter[str] = Counter()
    check_names(specs)
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


def resolve_set(
    target: object,
    adapters: AdapterSet,
    strength: float,
    cache: ResolveCache | None = None,
    tables: dict[str, AliasTable] | None = None,
) -> tuple[Plan, dict[str, AdapterWeights]]:
    """Plan with per-part strengths; `cache` (a ResolveCache) reuses loads and resolutions of sources seen
    before; `tables` reuses alias tables built for this target before."""
    specs = _specs(adapters, strength)
    items = _normalise_adapters(specs, cache.load if cache is not None else load_adapter)
    components = cache.components if cache is not None else as_components(target)
    fan = experts(components, {a.name: w for a, w in items})
    if cache is not None:
        p = cache.resolve([(a, w.strength) for a, w in items], [s.source for s, _ in specs], fan)
    else:
        p = resolve(components, [(a, w.strength) for a, w in items], tables, experts=fan)
    settings = {a.name: w for a, w in items}
    assign(p, settings)
    return p, settings


def adapter_summaries(plan: Plan, skipped: Sequence[Skipped] = ()) -> list[dict[str, object]]:
    """One dict per adapter; `keys_total` counts its keys less the `skipped` ones (`keys_skipped`)."""
    out: list[dict[str, object]] = []
    left_aside = Counter(s.adapter for s in skipped)
    for adapter in plan.adapters:
        parts: list[PlannedPart | PlannedParam] = [*plan.planned, *plan.params]
        planned = [pp for pp in parts if pp.adapter is adapter]
        out.append(
            {
                "name": adapter.name,
                "path": adapter.path,
                "layout": adapter.layout,
                "families": adapter.families,
                "alpha_sources": dict(Counter(pp.alpha_source for pp in planned)),
                "strength": plan.strengths[adapter.name],
                "keys_total": adapter.keys_total - left_aside[adapter.name],
                "keys_skipped": left_aside[adapter.name],
                "keys_applied": sum(
                    len(part.keys) for part in {id(pp.part): pp.part for pp in planned}.values()
                ),
            }
        )
    return out


def group_by_module(planned: list[PlannedPart]) -> dict[tuple[str, str], list[Contribution]]:
    groups: dict[tuple[str, str], list[Contribution]] = {}
    for pp in planned:
        for piece in pp.pieces:
            groups.setdefault((pp.component, piece.module), []).append(Contribution(pp, piece))
    return groups


def make_report(
    plan: Plan,
    mode: ApplyMode | Literal["plan"],
    applied: list[AppliedModule],
    unmatched: list[Unmatched],
    t0: float,
    skipped: Sequence[Skipped] = (),
) -> Report:
    """The report of `plan`: what was `applied`, every `unmatched` key, and the keys `skipped` on purpose
    (engine/decide.py `skipped_keys`: not misses, and not in keys_total)."""
    report = Report(
        mode=mode,
        adapters=adapter_summaries(plan, skipped),
        applied=applied,
        unmatched=unmatched,
        skipped=list(skipped),
    )
    report.keys_total = sum(a.keys_total for a in plan.adapters) - len(skipped)
    report.keys_applied = sum(a["keys_applied"] for a in report.adapters)
    report.seconds = time.perf_counter() - t0
    return report


def growth(p: Plan) -> list[tuple[str, str, int, str]]:
    """(component, module, width, config key) of every input a planned control adapter grows, once each."""
    found: dict[tuple[str, str], tuple[int, str]] = {}
    for pp in p.planned:
        for module, (width, key) in pp.grow.items():
            prev = found.get((pp.component, module))
            if prev is not None and prev[0] != width:
                raise ArgumentError(
                    f"adapters ask {pp.component}.{module} to grow to {prev[0]} and {width} columns"
                )
            found[(pp.component, module)] = (width, key)
    return [(c, m, w, k) for (c, m), (w, k) in found.items()]


def plan_layers(p: Plan, options: Options, mode: ApplyMode) -> tuple[WorkPlan, list[Unmatched]]:
    """Stack groups and a mechanism per layer; parts no layer takes move to the returned unmatched list."""
    unmatched = list(p.unmatched)
    groups = combine_groups(group_by_module(p.planned), p.components.modules, options.stack, options.density)
    return plan_work(p, groups, mode, unmatched, options.quant_settings()), unmatched


def notes_of(contribs: list[Contribution]) -> list[str]:
    return sorted({n for pp, _ in contribs for n in pp.notes})


def layer_entry(item: LayerWork, why: str, cost: str = "", backend: str = "") -> AppliedModule:
    """The report row of one installed layer."""
    names = sorted(adapter_names(item.contribs))
    assert item.mechanism is not None  # refused layers never reach the work list
    return AppliedModule(
        item.component, item.path, item.mechanism, names, why, cost, notes_of(item.contribs), backend=backend
    )


def _merge_layer(journal: Journal, item: LayerWork, options: Options) -> MergedModule:
    where = (item.component, item.path)
    try:
        return merge_module(item.module, item.contribs, journal.record, options.undo_with, where)
    except NonFiniteResultError as exc:
        raise NonFiniteResultError(f"{item.component}.{item.path}: {exc}") from None


def _runtime_layer(
    journal: Journal, item: LayerWork, options: Options, path_for: PathFor | None
) -> RuntimePath:
    rp = path_for(item.module, item.contribs) if path_for is not None else None
    rp = rp or RuntimePath(item.module, item.contribs)
    if options.compile_friendly:
        compiled = options.compiled()
        assert compiled is not None  # asked for, so validated settings
        prepare(rp, compiled, options.bucket_floors)
    journal.record(rp)  # recorded before the hook exists, so an interrupt cannot leave it behind
    rp.attach()
    return rp


def _quant_layer(
    journal: Journal, item: LayerWork, wp: WorkPlan, options: Options, backend: QuantBackend
) -> QuantWrite:
    assert item.mechanism is not None  # refused layers never reach the work list
    write = QuantWrite(
        item.module,
        backend,
        item.contribs,
        item.mechanism,
        host_rank=options.host_rank,
        cache=options.cache if item.mechanism == "hosted" else None,
        layer=f"{item.component}.{item.path}",
    )
    journal.record(write)  # recorded before the layer is touched: rollback finds it
    write.apply(wp.routes[(item.component, item.path)][1])
    return write


def install_layer(
    journal: Journal,
    item: LayerWork,
    mode: ApplyMode,
    wp: WorkPlan,
    options: Options,
    path_for: PathFor | None = None,
) -> AppliedModule:
    """Install one planned layer (merge, runtime path or quantized write), recorded in `journal` first.

    path_for(module, contribs) -> RuntimePath | None: a path to re-use instead of building one (switching)."""
    backend = wp.routes.get((item.component, item.path), (None, None))[0]
    backend_name = backend.name if backend is not None else ""
    if item.mechanism == "merge":
        merged = _merge_layer(journal, item, options)
        entry = layer_entry(item, item.why if mode == "auto" else "", backend=backend_name)
        merged.attach_entry(
            entry
        )  # the report follows the undo record (kind, bytes) through strength changes
        return entry
    if item.mechanism == "runtime":
        rp = _runtime_layer(journal, item, options, path_for)
        cost = "; ".join(sorted(rp.costs))
        return layer_entry(item, item.why if mode == "auto" else "", cost, backend_name)
    assert backend is not None  # a quantized layer has its route (its write reads it below)
    write = _quant_layer(journal, item, wp, options, backend)
    entry = layer_entry(item, item.why, backend=backend_name)
    entry.retention, entry.capture, entry.rank = write.retention, write.capture, write.rank
    entry.cache_hit, write.entry = write.cache_hit, entry
    return entry


def install(
    journal: Journal, p: Plan, wp: WorkPlan, mode: ApplyMode, options: Options, progress: bool | None = None
) -> list[AppliedModule]:
    """Grow inputs, then install every layer; the caller holds a journal transaction (all or nothing)."""
    for comp, path, width, key in growth(p):  # control adapters: the wider input exists before they land
        grow_input(p.components.modules[comp], path, width, key, record=journal.record)
    show = progress if progress is not None else (len(wp.work) > PROGRESS_LAYERS and on_terminal())
    with reused_buffers():  # one W' buffer and one set of block temporaries for every merged layer
        applied = [
            install_layer(journal, item, mode, wp, options)
            for item in bar(wp.work, desc="loraweave apply", unit="layer", enabled=show)
        ]
    applied += [
        AppliedModule(**row) for row in apply_params(p.params, p.components.modules, mode, journal.record)
    ]
    if options.undo == "none":  # a permanent fuse: the records kept this all-or-nothing until here
        fuse_all(journal.of(MergedModule))
    return applied


def fuse_all(merges: list[MergedModule]) -> None:
    """Release every record; merges deferred because no overflow is possible are written now, the last step
    of apply (nothing after it can fail), with Ctrl-C held until all of them are written."""
    with reused_buffers():
        for merged in merges:
            merged.reserve()
        with interrupts_held():
            for merged in merges:
                merged.fuse()


def finish_report(
    p: Plan,
    mode: ApplyMode,
    applied: list[AppliedModule],
    unmatched: list[Unmatched],
    wp: WorkPlan,
    t0: float,
) -> Report:
    report = make_report(p, mode, applied, unmatched, t0)
    if (
        wp.routes
    ):  # the backends this model uses (probing others would cost time for nothing) and broken imports
        used = {b.name: b for b, _ in wp.routes.values()}
        report.backends_unavailable = {n: why for n, why in broken().items()}
        report.backends_unavailable |= {n: why for n, b in used.items() if (why := b.unavailable())}
    return report
