"""Apply a LORA_STACK inside ComfyUI: (lora_name_or_path, model_strength, clip_strength) rows from any pack
(Efficiency, Easy-Use, LoRA Manager, ours), with a stack mode and block weights.

Every row is read with loraweave's readers and planned on ComfyUI's modules (comfy/targets.py). Then:
- block weights (a preset name, a comma-separated vector, or None) are read on the block map of the
  architecture loraweave resolves this model on (arch/blocks.py: UNet LBW slots, DiT chains such as Flux
  D00../S00..), and multiply each planned part's strength by its block's weight; text encoders take the BASE
  slot;
- stack modes (loraweave.stack): "sum" keeps every adapter as it is; "ties", "dare_ties", "dare_linear",
  "magnitude_prune" replace each layer several rows touch with one combined part (resolve/stacking.py), with
  `density` (default DEFAULT_DENSITY). The per-step select modes (klora, estlora) are refused here;
- mode "runtime" installs the result as one runtime entry per row (comfy/runtime.py: one injection key, no
  weight re-patched); "merge" adds it through ComfyUI's patch list (comfy/patches.py); "auto" asks
  comfy/api.py.

Rows whose two strengths are 0 are skipped, as core LoraLoader skips them. Inputs are never modified
(clones)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..arch.blocks import block_weights as slot_weights
from ..arch.blocks import chain_lengths, detect_block_arch, weights_for_modules
from ..arguments import number
from ..engine.decide import COMFY, NO_ARCH_CHECK, check_strengths, note_other_arch, refuse
from ..errors import ArgumentError
from ..modes import SELECT_MODES, STACK_MODES, StackMode
from ..report.report import Report
from ..resolve.params import PlannedParam
from ..resolve.planner import Plan, PlannedPart
from ..resolve.stacking import Contribution, combine_groups
from .runtime import (
    RuntimeEntry,
    entry_report,
    joint_report,
    renamed,
    stacked_clone,
    taken_names,
    unique_name,
)

DEFAULT_DENSITY = 0.5  # dense stack modes keep half of each layer's entries unless told otherwise
CUSTOM_BLOCKS = "custom"  # the block-preset choice that leaves block weights to the text (empty: all at 1)


class StackRow(NamedTuple):
    """One checked LORA_STACK row: a path (or, from Python, a state dict) and its two finite strengths."""

    source: Any
    model_strength: float
    clip_strength: float


def stack_rows(stack, resolve_name: Callable[[str], str] | None = None) -> list[StackRow]:
    """The one LORA_STACK reader: rows (lora, model_strength, clip_strength) from any pack, checked. A bad row
    is refused with ArgumentError naming its index: not a 3-item row, a source that is no path or state dict,
    a strength that is no finite number (NaN, inf, text, bool: the strength rule of `apply`).
    `resolve_name`: the nodes' lora_name -> file (lora_files.lora_path); then every source must be a name."""
    if isinstance(stack, (str, bytes)) or not isinstance(stack, Sequence):
        raise ArgumentError(
            f"lora_stack: expected a list of (lora_name, model_strength, clip_strength), got {stack!r}"
        )
    return [_stack_row(i, row, resolve_name) for i, row in enumerate(stack)]


def _stack_row(i: int, row, resolve_name: Callable[[str], str] | None) -> StackRow:
    where = f"lora_stack[{i}]"
    if not isinstance(row, (tuple, list)) or len(row) != 3:
        raise ArgumentError(f"{where}: expected (lora_name, model_strength, clip_strength), got {row!r}")
    source, model_strength, clip_strength = row
    if resolve_name is not None:
        if not isinstance(source, str):
            raise ArgumentError(f"{where}: the lora must be a lora_name (a string), got {source!r}")
        source = resolve_name(source)
    elif not isinstance(source, (str, os.PathLike)) and not hasattr(source, "keys"):
        raise ArgumentError(f"{where}: the lora must be a path or a state dict, got {source!r}")
    strengths = check_strengths(
        model_strength, clip_strength, labels=(f"{where} model_strength", f"{where} clip_strength")
    )
    return StackRow(source, *strengths)


def check_stack_mode(stack_mode: StackMode, density: float | None) -> float | None:
    """The density the mode uses (None for sum); ArgumentError for select modes and unknown names."""
    if stack_mode not in STACK_MODES:
        raise ArgumentError(f"stack_mode must be one of {', '.join(STACK_MODES)}, got {stack_mode!r}")
    if stack_mode in SELECT_MODES:
        raise ArgumentError(
            f"stack_mode {stack_mode!r} selects adapters per sampling step; the ComfyUI stack supports "
            f"{', '.join(m for m in STACK_MODES if m not in SELECT_MODES)}"
        )
    if stack_mode == "sum":
        return None
    value = DEFAULT_DENSITY if density is None else number(density, "density")
    if not 0.0 < value <= 1.0:
        raise ArgumentError(f"density must be in (0, 1], got {value}")
    return value


def chosen_block_weights(text: str, preset: str | None) -> str | None:
    """What a node's two block-weight widgets ask for: the text when it says anything (a preset name or a
    vector), else the preset picked (None or CUSTOM_BLOCKS: every block at 1)."""
    text = text.strip()
    if text:
        return text
    return None if preset in (None, CUSTOM_BLOCKS) else preset


def comfy_block_weights(patcher, value) -> tuple[dict[str, float], float]:
    """({ComfyUI module: block weight}, BASE weight) of `value` on the block map of the architecture loraweave
    resolves this model on; modules outside every block take BASE."""
    from .targets import reference_or_why

    found, why = reference_or_why(patcher)
    if found is None:
        raise ArgumentError(f"block_weights: loraweave has no block map for this model: {why}")
    reference, spans = found
    tree = reference.tree
    try:
        arch = detect_block_arch(tree)
        names = [n for n, _ in tree.named_modules()]
        chains = chain_lengths(arch, names)
        base = slot_weights(arch, value, chains=chains)["BASE"]
        table = weights_for_modules(arch, names, value, chains=chains)
    except ValueError as exc:
        raise ArgumentError(f"block_weights {value!r}: {exc}") from None
    out = {}
    for live, items in spans.items():
        weight = table.get(live)
        for original, *_ in items:
            out[original] = base if weight is None else weight
    return out, base


def weigh_blocks(plan: Plan, weights: dict[str, float], base: float) -> None:
    """Multiply every planned part's strength by its block's weight (text encoders: pass `weights` empty)."""
    parts: list[PlannedPart | PlannedParam] = [*plan.planned, *plan.params]
    for pp in parts:
        module = pp.pieces[0].module if isinstance(pp, PlannedPart) else pp.path
        pp.strength *= weights.get(module, base)


def combined_plan(plans: Sequence[Plan], stack_mode: StackMode, density: float | None) -> Plan:
    """One plan holding every row's parts; layers several rows touch combined per `stack_mode`."""
    joint = Plan(plans[0].components, [a for p in plans for a in p.adapters], {})
    groups: dict[tuple[str, str], list[Contribution]] = {}
    for plan in plans:
        for pp in plan.planned:
            for piece in pp.pieces:
                groups.setdefault((pp.component, piece.module), []).append(Contribution(pp, piece))
        joint.params += plan.params
    combined = combine_groups(groups, plans[0].components.modules, stack_mode, density)
    seen: dict[int, PlannedPart] = {}
    for contribs in combined.values():
        for pp, _ in contribs:
            seen.setdefault(id(pp), pp)
    joint.planned = list(seen.values())
    return joint


def _merge_side(patcher, plans: Sequence[Plan], stack_mode, density):
    from .patches import add_to_clone

    if not plans:
        return patcher.clone(), [], []
    return add_to_clone(patcher, combined_plan(plans, stack_mode, density), 1.0)


def apply_stack(
    model,
    clip,
    stack,
    stack_mode: StackMode = "sum",
    block_weights=None,
    mode="auto",
    density: float | None = None,
    allow_other_arch: bool = False,
) -> tuple[object, object, Report]:
    """(model, clip, report): clones of `model` / `clip` (None stays None) with every row of `stack`
    applied. A row whose file is for another architecture than the model's is refused (WrongArchitectureError)
    unless `allow_other_arch`, as `load_lora_for_models` refuses it."""
    from .api import choose_mode, file_arch_check, read_lora
    from .host import diffusion_patcher
    from .targets import plan_for_clip, plan_for_patcher

    diffusion_patcher(model)
    t0 = time.perf_counter()
    rows = [r for r in stack_rows(stack) if r.model_strength != 0.0 or r.clip_strength != 0.0]
    density = check_stack_mode(stack_mode, density)
    chosen = choose_mode(model, mode)
    weights, base = comfy_block_weights(model, block_weights) if block_weights is not None else ({}, 1.0)
    taken = taken_names(model, clip)
    model_plans, clip_plans = [], []
    adapters = [read_lora(row.source) for row in rows]
    arch = file_arch_check(model, adapters, allow_other_arch)
    for adapter, (_, model_strength, clip_strength) in zip(adapters, rows, strict=True):
        adapter = renamed(adapter, unique_name(adapter.name, taken))
        taken.append(adapter.name)
        model_plans.append(plan_for_patcher(model, adapter, model_strength, False))
        weigh_blocks(model_plans[-1], weights, base)
        if clip is not None:
            clip_plans.append(plan_for_clip(clip, adapter, clip_strength * base, False))
    if not rows:
        return model.clone(), clip.clone() if clip is not None else None, Report(mode=chosen)
    if chosen == "runtime":
        return _runtime(model, clip, model_plans, clip_plans, stack_mode, density, t0, arch)
    new_model, applied, refused = _merge_side(model, model_plans, stack_mode, density)
    new_clip = None
    if clip is not None:
        new_clip = clip.clone()
        new_clip.patcher, clip_applied, clip_refused = _merge_side(
            clip.patcher, clip_plans, stack_mode, density
        )
        applied, refused = applied + clip_applied, refused + clip_refused
    report = joint_report([*model_plans, *clip_plans], "merge", applied, refused, t0, model_only=clip is None)
    refuse(report, False, opt_ins=COMFY, arch=arch)
    note_other_arch(report, arch)
    report.log()
    return new_model, new_clip, report


def _runtime_side(patcher, plans: Sequence[Plan], stack_mode, density):
    """A clone with the stack as one runtime entry (its rows combined per `stack_mode`, then summed with what
    earlier loaders left on the patcher)."""
    entry = RuntimeEntry(
        "+".join(p.adapters[0].name for p in plans), combined_plan(plans, stack_mode, density)
    )
    return stacked_clone(patcher, [entry])


def _runtime(model, clip, model_plans, clip_plans, stack_mode, density, t0, arch=NO_ARCH_CHECK):
    new_model, state = _runtime_side(model, model_plans, stack_mode, density)
    states, new_clip = [state], clip.clone() if clip is not None else None
    # a CLIP nothing lands on keeps no state of ours
    if clip is not None and any(p.planned for p in clip_plans):
        new_clip.patcher, clip_state = _runtime_side(clip.patcher, clip_plans, stack_mode, density)
        states.append(clip_state)
    report = entry_report([*model_plans, *clip_plans], states, t0, model_only=clip is None)
    refuse(report, False, opt_ins=COMFY, arch=arch)
    note_other_arch(report, arch)
    report.log()
    return new_model, new_clip, report
