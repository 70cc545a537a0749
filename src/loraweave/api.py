"""Public entry points: `plan` (resolve and report, touch nothing) and `apply` (merge / runtime / auto)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from .engine.decide import ArchCheck, arch_check, model_arch_of, note_other_arch, refuse
from .engine.handle import Handle
from .engine.install import (
    AdapterSource,
    finish_report,
    group_by_module,
    install,
    make_report,
    notes_of,
    plan_layers,
    resolve_set,
)
from .engine.journal import Journal, model_lock
from .engine.options import Options
from .errors import ArgumentError
from .mechanisms.merge.checks import undo_settings
from .modes import ApplyMode, QuantizedMode, StackMode, UndoKind
from .report.coverage import warn_incomplete
from .report.report import AppliedModule, Report
from .request.spec import finite_strength
from .resolve.planner import Plan, PlannedPart
from .resolve.stacking import adapter_names
from .resolve.target import as_components
from .resolve.weights import AdapterWeights, assign

log = logging.getLogger("loraweave")
__all__ = ["AdapterSource", "Handle", "apply", "apply_planned", "plan"]


def plan(
    target, adapters: Iterable[AdapterSource] | AdapterSource, strength: float = 1.0, tables=None
) -> Report:
    """Resolve every key against `target` and report where it would land; nothing is modified.

    Works on models built on the `meta` device (no weights needed). `tables`: alias tables of `target` built
    before (`tools.skeleton.alias_tables`), when planning many adapters against one model."""
    t0 = time.perf_counter()
    p, _ = resolve_set(target, adapters, strength, tables=tables)
    applied = [
        AppliedModule(comp, path, "planned", sorted(adapter_names(contribs)), notes=notes_of(contribs))
        for (comp, path), contribs in group_by_module(p.planned).items()
    ]
    applied += [
        AppliedModule(pp.component, pp.path, "planned", [pp.adapter.name], notes=list(pp.notes))
        for pp in p.params
    ]
    report = make_report(p, "plan", applied, list(p.unmatched), t0)
    report.log()
    return report


def apply(
    target,
    adapters: Iterable[AdapterSource] | AdapterSource,
    mode: ApplyMode = "auto",
    strength: float = 1.0,
    strict: bool = False,
    progress: bool | None = None,
    stack: StackMode = "sum",
    density: float | None = None,
    quantized: QuantizedMode = "auto",
    host_rank: int = 256,
    cache=None,
    undo: UndoKind = "auto",
    undo_source=None,
    undo_on_device: bool = False,
    allow_empty: bool = False,
    compile_friendly: bool = False,
    rank_buckets: Sequence[int] | None = None,
    allow_other_arch: bool = False,
) -> Handle:
    """Apply adapters to `target` (module, mapping of components, or diffusers pipeline).

    mode: "merge" (into the weights, undoable), "runtime" (forward hooks, weights untouched), or "auto"
    (runtime where merging would be lossy or impossible: quantized, offloaded; merge elsewhere).
    stack: how adapters sharing a layer combine: "sum" (exact), "ties", "dare_ties", "dare_linear",
    "magnitude_prune" (with `density` in (0, 1]); DARE masks are deterministic per layer, adapters and
    settings. Items of `adapters` may be `AdapterSpec`s (strength, text-encoder strength, block weights,
    name). All-or-nothing: if anything raises midway, the model is left exactly as it was.

    Quantized layers (SDNQ, bitsandbytes, torchao, optimum-quanto, GGUF; see `loraweave.quant`):
    - mode="auto": a plain-LoRA set rides the layer's low-rank side channel exactly ("factor": SDNQ
      svd_up/down, no hook, no backup); anything else gets a runtime path beside the layer's own forward.
    - mode="runtime": always the runtime path (exact for every family and backend; storage untouched).
    - mode="merge": hook-free. Plain LoRA -> factor channel; otherwise int8-and-wider layers are requantized
      (dequantize, add, requantize with the layer's own config) and sub-8-bit layers follow the routing rule:
      requantize only if rms(ΔW)/grid step > 0.30 and hosting would capture < 0.90 of ΔW, else "hosted".
    quantized: "auto" (above), "host" (opt-in: in mode="auto", non-plain-LoRA sets take the hook-free route of
      mode="merge" instead of a hook, for compiled or hook-free deployments), or "requantize" (every hook-free
      layer is requantized, even plain LoRA; for measurements).
    host_rank: rank cap of a hosted truncation (randomized SVD, seeded locally: the caller's RNG is
      untouched); 0 disables hosting. The report gives the retention ρ and captured energy of hosted and
      requantized layers.
    cache: a `loraweave.mechanisms.runtime.factor_cache.FactorCache` (or a directory for one) that keeps
      hosted factors on disk; a replay is bit-identical to a fresh compute.
    undo: how a merged layer comes back bit-exactly (mechanisms/merge/undo.py): "auto" (per layer, the smaller
      of "compact" and "copy"), "compact" (only the elements round(W' - ΔW) misses), "copy" (a full copy),
      "source" (re-read from the model's safetensors files: `undo_source` = a file, a directory or {component:
      path}, else diffusers' config._name_or_path; refused on undo if a file changed) or "none" (a permanent
      fuse: remove() leaves those weights merged). Records live in host memory unless `undo_on_device`.

    Coverage is loud: an adapter whose keys did not all land gets one WARNING line (landed/total, top miss
    kinds, an example key). When not one key of an adapter lands, `NoKeysLandedError` (carrying the report) is
    raised and nothing changes, unless `allow_empty=True`. `strict=True` raises `StrictApplyError` unless
    every key lands. A file whose keys and shapes say it is for another architecture than the model's (an SD2
    LoRA on an SD1.5 UNet) raises `WrongArchitectureError` before anything changes, unless
    `allow_other_arch=True`: then it is applied and the report (summary, `other_arch`) and a WARNING say so.

    compile_friendly: runtime paths ready for `torch.compile`: ranks zero-padded to `rank_buckets` (default
      8/16/32/64/128; costs the padded FLOPs), strengths in tensors, hooks fixed for the handle's life, so
      strength changes, `disable`/`enable` and switches within a bucket never recompile (see
      mechanisms/runtime/compiled.py)."""
    options = Options(
        mode,
        stack,
        density,
        quantized,
        host_rank,
        None,  # set once the options are checked: a directory becomes a FactorCache
        compile_friendly=compile_friendly,
        rank_buckets=rank_buckets,
        undo=undo,
        undo_source=undo_source,
        undo_on_device=undo_on_device,
    )

    options.check()
    if cache is not None and not hasattr(cache, "load"):
        from .mechanisms.runtime.factor_cache import FactorCache

        cache = FactorCache(cache)
    options.cache = cache
    t0 = time.perf_counter()
    components = as_components(target)
    with model_lock(components.modules.values()):
        options.undo_with = undo_settings(undo, components.modules, undo_source, undo_on_device)
        p, settings = resolve_set(components, adapters, strength)
        arch = arch_check(p.adapters, model_arch_of(components), allow_other_arch)
        return _install_plan(p, settings, options, strict, allow_empty, progress, t0, arch)


def apply_planned(
    target, planned: list[PlannedPart], strength: float = 1.0, mode: ApplyMode = "auto"
) -> Handle:
    """Install parts of one adapter that an earlier `apply` on `target` resolved (`handle.planned`) as a new
    handle, at `strength`: their factors were read, checked and fitted then, so nothing is resolved again. The
    diffusers drop-in fuses an adapter it loaded this way."""
    t0 = time.perf_counter()
    options = Options(mode)
    options.check()
    if not planned or any(pp.adapter is not planned[0].adapter for pp in planned):
        raise ArgumentError("planned: apply_planned takes one or more planned parts of one adapter")
    adapter = planned[0].adapter
    components = as_components(target)
    with model_lock(components.modules.values()):
        options.undo_with = undo_settings(options.undo, components.modules)
        settings = {adapter.name: AdapterWeights(finite_strength(strength))}
        p = Plan(components, [adapter], {adapter.name: settings[adapter.name].strength})
        p.planned = [replace(pp, notes=list(pp.notes), grow=dict(pp.grow)) for pp in planned]
        assign(
            p, settings
        )  # strength and block weight of the copies; the earlier handle's parts stay as they are
        return _install_plan(p, settings, options, False, False, None, t0)


def _install_plan(
    p: Plan,
    settings: dict[str, AdapterWeights],
    options: Options,
    strict: bool,
    allow_empty: bool,
    progress: bool | None,
    t0: float,
    arch: ArchCheck | None = None,
) -> Handle:
    """apply's second half, under the model's lock: a mechanism per layer, installed all or nothing. `arch`:
    the files of another architecture (refused, or let through and said on the report)."""
    arch = arch or ArchCheck()
    mode = options.layer_mode(len(p.adapters))
    wp, unmatched = plan_layers(p, options, mode)
    refuse(make_report(p, mode, [], unmatched, t0), strict, allow_empty, arch=arch)
    journal = Journal()
    with journal.transaction():
        applied = install(journal, p, wp, mode, options, progress)
    report = finish_report(p, mode, applied, unmatched, wp, t0)
    note_other_arch(report, arch)
    report.log()
    warn_incomplete(report)
    handle = Handle(p, report, journal, settings, options)
    handle.start_selection()
    return handle
