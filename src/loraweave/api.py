"""Public entry points: `plan` (resolve and report, touch nothing) and `apply` (merge / runtime / auto)."""

from __future__ import annotations

import copy
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping

from tqdm.auto import tqdm

from .errors import StrictApplyError
from .formats.adapter import Adapter, load_adapter
from .handle import Handle, finite_strength
from .mechanisms.choose import QUANTIZED, QuantSettings, plan_work
from .mechanisms.grow import GrownInput, grow_input
from .mechanisms.merge import Contribution, MergedModule, merge_module, undo_settings
from .mechanisms.quantized import QuantWrite
from .mechanisms.runtime import RuntimePath
from .plan.resolve import Plan, PlannedPart, resolve
from .plan.stacking import adapter_names, combine_groups
from .plan.target import as_components
from .plan.weights import AdapterWeights, assign
from .quant import broken
from .report import AppliedModule, Report
from .spec import AdapterSpec
from .stack.combine import SELECT_MODES, validate_stack

log = logging.getLogger("loraweave")
MODES = ("auto", "merge", "runtime")
# What `adapters` may hold: a path, an Adapter, a state dict, (source, strength) or an AdapterSpec.
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
        te = None if spec.te_strength is None else finite_strength(float(spec.te_strength) * float(strength))
        out.append((spec, AdapterWeights(finite_strength(float(spec.strength) * float(strength)), te, spec.block_weights)))
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


def plan(target, adapters: Iterable[AdapterSource] | AdapterSource, strength: float = 1.0) -> Report:
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


def apply(
    target,
    adapters: Iterable[AdapterSource] | AdapterSource,
    mode: str = "auto",
    strength: float = 1.0,
    strict: bool = False,
    progress: bool | None = None,
    stack: str = "sum",
    density: float | None = None,
    quantized: str = "auto",
    host_rank: int = 256,
    cache=None,
    undo: str = "auto",
    undo_source=None,
    undo_on_device: bool = False,
) -> Handle:
    """Apply adapters to `target` (module, mapping of components, or diffusers pipeline).

    mode: "merge" (into the weights, undoable), "runtime" (forward hooks, weights untouched), or "auto"
    (runtime where merging would be lossy or impossible: quantized, offloaded; merge elsewhere).
    stack: how adapters sharing a layer combine: "sum" (exact), "ties", "dare_ties", "dare_linear",
    "magnitude_prune" (with `density` in (0, 1]); DARE masks are deterministic per layer, adapters and settings.
    Items of `adapters` may be `AdapterSpec`s (strength, text-encoder strength, block weights, name).
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
      on disk; a replay is bit-identical to a fresh compute.
    undo: how a merged layer comes back bit-exactly (mechanisms/undo.py): "auto" (per layer, the smaller of
      "compact" and "copy"), "compact" (only the elements round(W' - ΔW) misses), "copy" (a full copy), "source"
      (re-read from the model's safetensors files: `undo_source` = a file, a directory or {component: path},
      else diffusers' config._name_or_path; refused on undo if a file changed) or "none" (a permanent fuse:
      remove() leaves those weights merged). Records live in host memory unless `undo_on_device`."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    validate_stack(stack, density)
    if quantized not in QUANTIZED:
        raise ValueError(f"quantized must be one of {QUANTIZED}, got {quantized!r}")
    if not isinstance(host_rank, int) or host_rank < 0:
        raise ValueError(f"host_rank must be an int >= 0, got {host_rank!r}")
    if cache is not None and not hasattr(cache, "load"):
        from .mechanisms.factor_cache import FactorCache

        cache = FactorCache(cache)
    t0 = time.perf_counter()
    p, settings = _resolve(target, adapters, strength)
    undo_with = undo_settings(undo, p.components.modules, undo_source, undo_on_device)
    select = stack in SELECT_MODES
    if select:
        validate_stack(stack, density, len(p.adapters))
        if mode == "merge":
            raise ValueError(f"stack={stack!r} switches layers between adapters per step: use mode='runtime'")
        mode = "runtime"
    unmatched = list(p.unmatched)
    groups = combine_groups(_group_by_module(p.planned), p.components.modules, stack, density)
    wp = plan_work(p, groups, mode, unmatched, QuantSettings(quantized, host_rank, cache))
    work, prepared, routes = wp.work, wp.prepared, wp.routes
    if strict and unmatched:
        report = _make_report(p, mode, [], unmatched, t0)
        raise StrictApplyError(f"strict: {len(unmatched)} keys did not land ({report.reasons()})", report)
    merged: list[MergedModule] = []
    runtime: list[RuntimePath] = []
    quant: list[QuantWrite] = []
    applied: list[AppliedModule] = []
    grown: list[GrownInput] = []
    show = progress if progress is not None else (len(work) > 200 and sys.stderr.isatty())
    try:
        for comp, path, width, key in _growth(p):  # control adapters: the wider input exists before they land
            grown.append(grow_input(p.components.modules[comp], path, width, key))
        for comp, path, module, mechanism, why, contribs in tqdm(work, desc="loraweave", disable=not show, unit="layer"):
            cost = ""
            backend = routes.get((comp, path), (None, None))[0]
            write = None
            if mechanism == "merge":
                merge_module(module, contribs, merged, undo_with, (comp, path))
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
            names = sorted(adapter_names(contribs))
            notes = sorted({n for pp, _ in contribs for n in pp.notes})
            show_why = why if mode == "auto" or write is not None else ""
            entry = AppliedModule(comp, path, mechanism, names, show_why, cost, notes,
                                  backend=backend.name if backend is not None else "")
            if write is not None:
                entry.retention, entry.capture, entry.rank = write.retention, write.capture, write.rank
                entry.cache_hit, write.entry = write.cache_hit, entry
            if mechanism == "merge":
                merged[-1].entry = entry
                merged[-1]._report()
            applied.append(entry)
        if undo == "none":  # a permanent fuse: the records kept the apply all-or-nothing until here
            for m in merged:
                m.fuse()
    except BaseException:
        for rp in runtime:
            rp.detach()
        for w in reversed(quant):
            w.restore()
        for m in reversed(merged):
            m.restore()
        for g in reversed(grown):
            g.restore()
        log.warning("loraweave apply failed midway; model restored to its state before the call")
        raise
    report = _make_report(p, mode, applied, unmatched, t0)
    if routes:  # the backends this model uses (probing others would cost time for nothing) and broken imports
        used = {b.name: b for b, _ in routes.values()}
        report.backends_unavailable = {n: why for n, why in broken().items()}
        report.backends_unavailable |= {n: why for n, b in used.items() if (why := b.unavailable())}
    report.log()
    handle = Handle(p, report, merged, runtime, settings, grown, quant)
    handle.quant_options = {"quantized": quantized, "host_rank": host_rank, "cache": cache}
    handle.undo_options = {"undo": undo, "undo_source": undo_source, "undo_on_device": undo_on_device}
    handle.undo_with = undo_with
    if select:  # every shared layer starts on the subject (step 0 of any schedule)
        handle._select = (stack, (p.adapters[0].name, p.adapters[1].name))
        from .mechanisms.select import choose, shared_layers

        for rp in shared_layers(handle._runtime_by_key(), handle._select[1]).values():
            choose(rp, handle._select[1], 0)
    return handle
