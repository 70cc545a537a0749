"""`load_lora_for_models`: the script API and the core of the loader nodes; mirrors `comfy.sd.load_lora_for_models`.

mode "merge": loraweave's exact ΔW through ComfyUI's patch list (patches.py); "runtime": loraweave's runtime path
inside ComfyUI (runtime.py); "auto": merge on floating-point bases, runtime where ComfyUI holds the base weights
quantized (fp8 dtypes, GGUF or ComfyUI's QuantizedTensor): a merge there rounds ΔW into the quantized grid at every
load (GGUF even re-dequantises and re-patches at every step), the runtime path keeps it exact and the storage as is.
The inputs are never modified: every result is a clone, and on any error nothing was added anywhere."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Mapping

import torch

from ..engine.install import make_report
from ..errors import ArgumentError, ArgumentTypeError, StrictApplyError
from ..formats.adapter import Adapter, load_adapter
from ..modes import APPLY_MODES, ApplyMode
from ..report.coverage import refuse_empty, warn_incomplete
from ..report.miss import Miss, Unmatched
from ..report.report import Report, failures
from ..request.spec import finite_strength
from ..resolve.planner import Plan
from .host import diffusion_patcher
from .patches import add_to_clone
from .targets import TEXT_ENCODER_NAMES, plan_for_clip, plan_for_patcher

log = logging.getLogger("loraweave")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Parsed files kept for a re-queue (a strength change re-reads nothing). Each holds its whole file in memory, so
# the older ones are also bounded by bytes; the newest is always kept (core's LoraLoader keeps one file per node).
ADAPTERS_KEPT = 4
ADAPTER_BYTES_KEPT = 2 * 2**30
_parsed: OrderedDict[tuple, Adapter] = OrderedDict()
NO_CLIP = Miss("no_such_component", "no such component: the file has text-encoder keys and no CLIP was given")


def read_lora(lora) -> Adapter:
    """A loraweave Adapter from what a ComfyUI caller holds: a path (str/PathLike), a state dict or an Adapter."""
    if isinstance(lora, Adapter):
        return lora
    if isinstance(lora, (str, os.PathLike)):
        return _cached_file(lora)
    if isinstance(lora, Mapping):
        return load_adapter(lora)
    raise ArgumentTypeError(f"lora must be a path, a state dict or an Adapter, not {type(lora).__name__}")


def _file_identity(path) -> tuple | None:
    """What changes whenever the file's bytes may have: inode, size, mtime and ctime (ctime no tool can set back).
    None for what is not one regular file (a PEFT directory: its files change under an unchanged folder)."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # load_adapter names the file in its typed error
    if not stat.S_ISREG(st.st_mode):
        return None
    return (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _cached_file(path) -> Adapter:
    """The parsed adapter of `path`, re-read whenever its identity changed (bounded LRU, never stale data)."""
    key = _file_identity(path)
    if key is None or key not in _parsed:
        # Read whole: the runtime paths keep the factors as read (no copy) and no later write to the file reaches
        # them; core's LoraLoader holds the whole file in memory the same way.
        adapter = load_adapter(path, read=True)
        if key is not None and _file_identity(path) == key:  # unchanged while it was read
            _parsed[key] = adapter
            _bound_cache()
        return adapter
    _parsed.move_to_end(key)
    return _parsed[key]


def _bound_cache() -> None:
    """Drop the least recently used files beyond ADAPTERS_KEPT, or beyond ADAPTER_BYTES_KEPT (file sizes, the
    identity's st_size), never the newest."""
    held = lambda: sum(key[3] for key in _parsed)  # noqa: E731
    while len(_parsed) > ADAPTERS_KEPT or (len(_parsed) > 1 and held() > ADAPTER_BYTES_KEPT):
        key, _ = _parsed.popitem(last=False)
        log.debug("comfy_cache=drop file=%s bytes=%d", key[0], key[3])


def quantized_base(patcher) -> bool:
    """Whether ComfyUI holds any diffusion-model weight in a quantized form (a dtype or a tensor subclass)."""
    return any(
        p.dtype not in FLOAT_DTYPES or type(p.data) is not torch.Tensor
        for p in patcher.model.diffusion_model.parameters()
    )


def choose_mode(patcher, mode: ApplyMode) -> ApplyMode:
    if mode not in APPLY_MODES:
        raise ArgumentError(f"mode must be one of {', '.join(APPLY_MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    return "runtime" if quantized_base(patcher) else "merge"


def _clip_side(clip, adapter: Adapter) -> tuple[Plan | None, list[Unmatched]]:
    if clip is not None:
        plan = plan_for_clip(clip, adapter)
        return plan, list(plan.unmatched)
    keys = [k for p in adapter.parts if p.component in TEXT_ENCODER_NAMES for k in p.keys]
    return None, [Unmatched(adapter.name, k, NO_CLIP) for k in keys]


def _check(report: Report, strict: bool) -> None:
    """Refusals before anything is cloned: strict with misses, or a file of which no key lands."""
    if strict and failures(report.unmatched):
        raise StrictApplyError(
            f"strict: {len(failures(report.unmatched))} keys of {report.adapters[0]['name']} did not land "
            f"({report.kinds()})",
            report,
        )
    refuse_empty(report)


def _plans(model, clip, adapter: Adapter) -> tuple[Plan, Plan | None, Plan, list[Unmatched]]:
    """(model side, CLIP side or None, both sides as one plan, every miss) of `adapter` on ComfyUI's modules."""
    model_plan = plan_for_patcher(model, adapter)
    clip_plan, clip_misses = _clip_side(clip, adapter)
    both = Plan(model_plan.components, [adapter], {adapter.name: 1.0})
    both.planned = model_plan.planned + (clip_plan.planned if clip_plan else [])
    both.params = model_plan.params + (clip_plan.params if clip_plan else [])
    return model_plan, clip_plan, both, model_plan.unmatched + clip_misses


def judge(model, lora, clip=None) -> Report:
    """The loader's plan of `lora` on `model` (and `clip`) as a report of mode "plan": which keys would land on
    this ComfyUI model's own modules, and why each other one would not. Nothing is cloned or patched."""
    diffusion_patcher(model)
    t0 = time.perf_counter()
    *_, both, unmatched = _plans(model, clip, read_lora(lora))
    return make_report(both, "plan", [], unmatched, t0)


def merge(model, clip, adapter: Adapter, strength_model: float, strength_clip: float, strict: bool = False):
    """(model clone, clip clone or None, report): loraweave's ΔW added through ComfyUI's patch lists."""
    t0 = time.perf_counter()
    model_plan, clip_plan, both, unmatched = _plans(model, clip, adapter)
    _check(make_report(both, "merge", [], unmatched, t0), strict)
    new_model, applied, refused = add_to_clone(model, model_plan, strength_model)
    new_clip = None
    if clip is not None:
        new_clip = clip.clone()
        new_clip.patcher, clip_applied, clip_refused = add_to_clone(clip.patcher, clip_plan, strength_clip)
        applied, refused = applied + clip_applied, refused + clip_refused
    report = make_report(both, "merge", applied, unmatched + refused, t0)
    _check(report, strict)
    report.log()
    warn_incomplete(report)
    return new_model, new_clip, report


def load_lora_for_models(
    model,
    clip,
    lora,
    strength_model: float,
    strength_clip: float,
    mode: ApplyMode = "auto",
    strict: bool = False,
):
    """(model, clip, report) as `comfy.sd.load_lora_for_models`: `lora` is a path or a state dict (or a loraweave
    Adapter), `clip` may be None (then None comes back). New clones come back; the inputs are never modified.

    Errors are typed loraweave errors: a missing or broken file, a file of which no key lands on this model
    (NoKeysLandedError: a file for another architecture), `strict` with keys that miss (StrictApplyError)."""
    diffusion_patcher(model)
    strength_model = finite_strength(strength_model, "strength_model")
    strength_clip = finite_strength(strength_clip, "strength_clip")
    chosen = choose_mode(model, mode)
    adapter = read_lora(lora)
    log.info("comfy load adapter=%s mode=%s chosen=%s", adapter.name, mode, chosen)
    if chosen == "runtime":
        from .runtime import apply_runtime

        return apply_runtime(model, clip, adapter, strength_model, strength_clip, strict)
    return merge(model, clip, adapter, strength_model, strength_clip, strict)
