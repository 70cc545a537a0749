"""`load_lora_for_models`: the script API and the core of the loader nodes; mirrors
`comfy.sd.load_lora_for_models`.

mode "merge": loraweave's exact ΔW through ComfyUI's patch list (patches.py); "runtime": loraweave's runtime
path inside ComfyUI (runtime.py); "auto": the engine's choice (engine/decide.py `chosen_mode`) given what
ComfyUI knows, whether it holds the base weights quantized (fp8 dtypes, GGUF or ComfyUI's QuantizedTensor):
runtime there, merge on floating-point bases. Validation and the strict and empty refusals are the engine's
too. The inputs are never modified: every result is a clone, and on any error nothing was added anywhere."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import torch

from ..arch.fit import ModelArch, model_arch
from ..engine.decide import (
    COMFY,
    NO_ARCH_CHECK,
    ArchCheck,
    WholeModelMode,
    arch_check,
    check_mode,
    check_strengths,
    chosen_mode,
    note_other_arch,
    refuse,
    skipped_keys,
)
from ..engine.install import make_report
from ..errors import ArgumentTypeError
from ..formats.adapter import Adapter, load_adapter
from ..io.file_cache import BYTES_KEPT, FileCache
from ..modes import ApplyMode
from ..report.coverage import warn_incomplete
from ..report.miss import Skipped, Unmatched
from ..report.report import Report
from ..resolve.modality import check_modality_strengths
from ..resolve.planner import Plan
from .gguf_weights import GGUF_BACKEND, check_storage, note_rows
from .grow import plan_notes
from .host import diffusion_patcher
from .patches import add_to_clone
from .quantized import check_layouts, with_retention
from .targets import comfy_arch, plan_for_clip, plan_for_patcher

log = logging.getLogger("loraweave")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Parsed files kept for a re-queue (a strength change re-reads nothing), keyed by what the file is
# (io.file_cache): each holds its whole file in memory, so the older ones are also bounded by bytes.
ADAPTERS_KEPT = 4
ADAPTERS: FileCache[Adapter] = FileCache(ADAPTERS_KEPT, BYTES_KEPT)


def read_lora(lora) -> Adapter:
    """A loraweave Adapter from what a ComfyUI caller holds: a path (str/PathLike), a state dict or an
    Adapter. A file is read whole (the runtime paths keep the factors as read, and no later write to the file
    reaches them; core's LoraLoader holds the whole file in memory the same way) and kept in ADAPTERS."""
    if isinstance(lora, Adapter):
        return lora
    if isinstance(lora, (str, os.PathLike)):
        return ADAPTERS.read(lora, _read_whole)
    if isinstance(lora, Mapping):
        return load_adapter(lora)
    raise ArgumentTypeError(f"lora must be a path, a state dict or an Adapter, not {type(lora).__name__}")


def _read_whole(path) -> Adapter:
    return load_adapter(path, read=True)


def quantized_base(patcher) -> bool:
    """Whether ComfyUI holds any diffusion-model weight in a quantized form (a dtype or a tensor subclass)."""
    return any(
        p.dtype not in FLOAT_DTYPES or type(p.data) is not torch.Tensor
        for p in patcher.model.diffusion_model.parameters()
    )


def choose_mode(patcher, mode: ApplyMode) -> WholeModelMode:
    """The engine's mode choice (engine/decide.py) given ComfyUI's fact: does it hold the base quantized."""
    mode = check_mode(mode)
    return chosen_mode(mode, mode == "auto" and quantized_base(patcher))


def comfy_model_arch(patcher) -> ModelArch | None:
    """ComfyUI's fact about a MODEL's architecture: its supported_models class (targets.comfy_arch)."""
    return model_arch(comfy_arch(patcher))


def file_arch_check(patcher, adapters: list[Adapter], allow_other_arch: bool) -> ArchCheck:
    """The files of another architecture than this MODEL's, for the engine's refusal (engine/decide.py)."""
    return arch_check(adapters, comfy_model_arch(patcher), allow_other_arch)


def _plans(
    model, clip, adapter: Adapter, modality_strengths: dict[str, float] | None = None
) -> tuple[Plan, Plan | None, Plan, list[Unmatched], list[Skipped]]:
    """(model side, CLIP side or None, both sides as one plan, every miss, the keys skipped) of `adapter` on
    ComfyUI's modules. No CLIP: a model-only request, whose text-encoder keys the engine skips."""
    model_plan = plan_for_patcher(model, adapter, modality_strengths=modality_strengths)
    clip_plan = plan_for_clip(clip, adapter) if clip is not None else None
    both = Plan(model_plan.components, [adapter], {adapter.name: 1.0})
    both.planned = model_plan.planned + (clip_plan.planned if clip_plan else [])
    both.params = model_plan.params + (clip_plan.params if clip_plan else [])
    unmatched = model_plan.unmatched + (clip_plan.unmatched if clip_plan else [])
    return model_plan, clip_plan, both, unmatched, skipped_keys([adapter], model_only=clip is None)


def judge(model, lora, clip=None) -> Report:
    """The loader's plan of `lora` on `model` (and `clip`) as a report of mode "plan": which keys would land
    on this ComfyUI model's own modules, and why each other one would not; without `clip`, the text-encoder
    keys are skipped as the model-only loader skips them. Nothing is cloned or patched."""
    diffusion_patcher(model)
    t0 = time.perf_counter()
    *_, both, unmatched, skipped = _plans(model, clip, read_lora(lora))
    return make_report(both, "plan", [], unmatched, t0, skipped)


def merge(
    model,
    clip,
    adapter: Adapter,
    strength_model: float,
    strength_clip: float,
    strict: bool = False,
    arch: ArchCheck = NO_ARCH_CHECK,
    modality_strengths: dict[str, float] | None = None,
):
    """(model clone, clip clone or None, report): loraweave's ΔW added through ComfyUI's patch lists."""
    t0 = time.perf_counter()
    model_plan, clip_plan, both, unmatched, skipped = _plans(model, clip, adapter, modality_strengths)
    refuse(make_report(both, "merge", [], unmatched, t0, skipped), strict, opt_ins=COMFY, arch=arch)
    check_storage(model_plan)
    new_model, applied, refused = add_to_clone(model, model_plan, strength_model)
    plan_notes(applied, model_plan)
    note_rows(applied, model_plan, new_model)  # GGUF rows: ComfyUI-GGUF patches them at every forward
    with_retention(new_model, [r for r in applied if r.backend != GGUF_BACKEND])
    new_clip = None
    if clip_plan is not None:  # planned exactly when a CLIP is given
        new_clip = clip.clone()
        new_clip.patcher, clip_applied, clip_refused = add_to_clone(clip.patcher, clip_plan, strength_clip)
        with_retention(new_clip.patcher, clip_applied)
        applied, refused = applied + clip_applied, refused + clip_refused
    report = make_report(both, "merge", applied, unmatched + refused, t0, skipped)
    refuse(report, strict, opt_ins=COMFY, arch=arch)
    note_other_arch(report, arch)
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
    allow_other_arch: bool = False,
    modality_strengths: Mapping[str, float] | None = None,
):
    """(model, clip, report) as `comfy.sd.load_lora_for_models`: `lora` is a path or a state dict (or a
    loraweave Adapter), `clip` may be None (then None comes back, and the text-encoder keys are skipped as
    core's LoraLoaderModelOnly skips them: `report.skipped`, no misses). New clones come back; the inputs are
    never modified.

    Errors are typed loraweave errors, raised before anything is cloned: a missing or broken file, a file
    whose keys and shapes say it is for another architecture than this model's (WrongArchitectureError; with
    `allow_other_arch=True` it is applied and the report and a WARNING say so), a file of which no key lands
    (NoKeysLandedError), `strict` with keys that miss (StrictApplyError), a quantized weight in a layout
    comfy_kitchen does not register (QuantizedLayoutError, naming the layer). On quantized weights
    (comfy_kitchen QuantizedTensor, float8) `auto` runs at runtime; `merge` goes through ComfyUI's
    requantization and each such layer's report row carries the ΔW retention ρ it measured
    (comfy/quantized.py). `modality_strengths` ({"video", "audio", "cross": strength}) scales an
    audio-video model's modules by modality (AdapterSpec.modality_strengths; ArgumentError on a model
    without modalities)."""
    diffusion_patcher(model)
    modalities = check_modality_strengths(modality_strengths, "modality_strengths")
    check_layouts(model)
    strength_model, strength_clip = check_strengths(
        strength_model, strength_clip, labels=("strength_model", "strength_clip")
    )
    chosen = choose_mode(model, mode)
    adapter = read_lora(lora)
    arch = file_arch_check(model, [adapter], allow_other_arch)
    log.info("comfy load adapter=%s mode=%s chosen=%s", adapter.name, mode, chosen)
    if chosen == "runtime":
        from .runtime import apply_runtime

        return apply_runtime(model, clip, adapter, strength_model, strength_clip, strict, arch, modalities)
    return merge(model, clip, adapter, strength_model, strength_clip, strict, arch, modalities)


def merge_clip(clip, lora, strength_clip: float):
    """(clip, report or None): a clone of `clip` with the text-encoder keys of `lora` (a path, a state dict or
    an Adapter) merged at `strength_clip` as the loader merges them (strength_model 0: the denoiser keys are
    the caller's); a file without text-encoder keys gives back `clip` itself and no report. The input is not
    modified."""
    t0 = time.perf_counter()
    (strength_clip,) = check_strengths(strength_clip, labels=("strength_clip",))
    adapter = read_lora(lora)
    plan = plan_for_clip(clip, adapter)
    if not plan.planned:
        return clip, None
    new_clip = clip.clone()
    new_clip.patcher, applied, refused = add_to_clone(clip.patcher, plan, strength_clip)
    with_retention(new_clip.patcher, applied)
    report = make_report(plan, "merge", applied, plan.unmatched + refused, t0, [])
    report.log()
    return new_clip, report
