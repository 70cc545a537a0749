"""Runtime mode inside ComfyUI: loraweave's runtime paths on a cloned ModelPatcher, weights never touched.

Everything one patcher carries lives under ONE pack-owned key (`KEY`):
- the attachment: a `RuntimeState` holding every loader's entry (loader order) and the runtime paths built
  from all of them, one rank-concatenated path per layer; a second loader makes a new state with its entry
  appended (never a nested injection), so N loaders cost one extra GEMM pair per layer, not N;
- the injection (`set_injections`, the module surgery ComfyUI's own bypass LoRA uses, here under our own key):
  the paths are attached when ComfyUI injects the model (after `patch_model`, on load) and detached when it
  ejects it (unload, re-patch, `detach`; also around every weight (re)load), so the input patcher and the
  shared modules are exactly as they were whenever this clone is not loaded;
- an additional model (`set_additional_models`): a ModelPatcher over a module holding every adapter tensor
  the paths read (FactorHolder: whatever RuntimePath.caches reads), so model management counts and moves them;
- an APPLY_MODEL wrapper when an entry has a step window (comfy/steps.py).

A strength change or another loader re-runs the loader node: a new clone with a new state. `patches` and
`patches_uuid` are never touched, so ComfyUI re-patches no weight (no `calculate_weight` call); re-loading
only ejects the old paths and injects the new ones. Why injections rather than bypass or weight wrappers: the
core bypass key holds one LoRA (a second loader replaces the first) and moves factors outside model
management, and `add_weight_wrapper` re-rolls `patches_uuid` (a re-patch) without seeing the input."""

from __future__ import annotations

import copy
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..engine.decide import COMFY, NO_ARCH_CHECK, ArchCheck, note_other_arch, refuse, skipped_keys
from ..engine.install import make_report
from ..mechanisms.runtime.host import runtime_blocker
from ..mechanisms.runtime.path import RuntimePath
from ..modes import ApplyMode
from ..report.coverage import warn_incomplete
from ..report.miss import Miss, Unmatched
from ..report.report import AppliedModule, Report
from ..resolve.params import PlannedParam
from ..resolve.planner import Plan, PlannedPart
from ..resolve.stacking import Contribution
from .gguf_weights import check_storage, note_rows
from .grow import add_notes, grow_patches, grown_inputs, plan_notes
from .holder import FactorHolder

log = logging.getLogger("loraweave")
# the one key the pack owns on a ModelPatcher: attachment, injection, additional model, wrapper
KEY = "loraweave"


NOT_TAKEN = Miss(
    "no_such_component", "no such component: no patcher given takes this key (text-encoder keys need a CLIP)"
)
PARAM_AT_RUNTIME = (
    "runtime mode has no path for a bare parameter (it would re-patch the weight): use mode=merge"
)


@dataclass(frozen=True)
class RuntimeEntry:
    """One loader's adapter on one patcher: its plan (part strengths set) and, for a step window, the gate
    (sigma, model_sampling) -> factor (comfy/steps.py) applied to the adapter on every layer it touches."""

    name: str
    plan: Plan
    gate: Callable[[float, object], float] | None = None


@dataclass(eq=False)
class Factors:
    """A FactorHolder and the one ModelPatcher over it, shared by every state whose paths read the same
    tensors (a strength change copies the paths, not the factors). The patcher lives exactly as long as the
    holder: model management takes a loaded model whose patcher is gone while its module lives for a leak, and
    then runs a full `gc.collect()` before every later load (what a per-clone patcher over a kept holder
    caused)."""

    holder: FactorHolder
    patcher: object | None = None  # made on the first install: it takes the base patcher's devices

    def patcher_for(self, base):
        if self.patcher is None:
            from comfy.model_patcher import ModelPatcher

            self.patcher = ModelPatcher(
                self.holder, load_device=base.load_device, offload_device=base.offload_device
            )
        return self.patcher


@dataclass
class RuntimeState:
    """Every entry on one patcher and the runtime paths built from all of them; attached while injected."""

    entries: tuple[RuntimeEntry, ...]
    paths: list[RuntimePath] = field(default_factory=list)
    blocked: list[Unmatched] = field(default_factory=list)
    factors: Factors | None = None  # given: a strength change shares the earlier state's holder and patcher
    injected: bool = False

    def __post_init__(self) -> None:
        if not (self.paths or self.blocked):  # given: a strength change reuses an earlier state's paths
            self.paths, self.blocked = build_paths(self.entries)
        if self.factors is None:
            self.factors = Factors(FactorHolder(self.paths))
        self.last_gates: dict[str, float] = {}

    @property
    def holder(self) -> FactorHolder:
        assert self.factors is not None  # set by __post_init__
        return self.factors.holder

    def on_model_patcher_clone(self) -> RuntimeState:
        return (
            self  # clones share the state; a new loader makes a new one (stacked_clone), never mutates this
        )

    def inject(self, patcher=None) -> None:
        if self.injected:
            return
        self.holder.repoint()  # paths reused from a kept build share term caches with its other states
        for rp in self.paths:
            rp.attach()
        self.injected = True
        self.last_gates = {}

    def eject(self, patcher=None) -> None:
        if not self.injected:
            return
        for rp in self.paths:
            rp.detach()
        self.injected = False

    def set_gates(self, sigma: float, model_sampling) -> None:
        """Write each windowed entry's factor at `sigma` into the paths' scale vectors (no re-merge)."""
        for entry in self.entries:
            if entry.gate is None:
                continue
            value = float(entry.gate(sigma, model_sampling))
            if self.last_gates.get(entry.name) == value:
                continue
            self.last_gates[entry.name] = value
            for rp in self.paths:
                if entry.name in rp.adapters:
                    rp.set_gate(entry.name, value)

    def factor_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.holder.parameters())


def build_paths(entries: Sequence[RuntimeEntry]) -> tuple[list[RuntimePath], list[Unmatched]]:
    """One RuntimePath per layer from every entry's planned parts (their ranks concatenated: a sum)."""
    groups: dict[tuple[str, str], list[Contribution]] = {}
    modules: dict[str, torch.nn.Module] = {}
    for entry in entries:
        modules |= entry.plan.components.modules
        for pp in entry.plan.planned:
            for piece in pp.pieces:
                groups.setdefault((pp.component, piece.module), []).append(Contribution(pp, piece))
    paths: list[RuntimePath] = []
    blocked = [
        Unmatched(
            param.adapter.name,
            key,
            Miss("no_mechanism", f"{param.component}.{param.path}: {PARAM_AT_RUNTIME}"),
        )
        for entry in entries
        for param in entry.plan.params
        for key in param.part.keys
    ]
    for (component, path), contribs in groups.items():
        module = modules[component].get_submodule(path)
        why = runtime_blocker(module)
        if why is not None:
            for pp, _ in contribs:
                blocked += [
                    Unmatched(pp.adapter.name, key, Miss("unsupported", f"{component}.{path}: {why}"))
                    for key in pp.part.keys
                ]
            continue
        paths.append(RuntimePath(module, contribs))  # borrows the factors of files read whole
    return paths, blocked


def window_wrapper(state: RuntimeState):
    """The APPLY_MODEL wrapper of `state`: set every gated entry's factor for this call's sigma, then run."""

    def apply_model(executor, x, t, *args, **kwargs):
        state.set_gates(float(t.reshape(-1)[0]), executor.class_obj.model_sampling)
        return executor(x, t, *args, **kwargs)

    return apply_model


def install_state(patcher, state: RuntimeState, wrapper: Callable | None = None) -> None:
    """Put `state` under KEY on `patcher` (a fresh clone): attachment, injection, factor model, wrapper."""
    from comfy.patcher_extension import PatcherInjection, WrappersMP

    patcher.set_attachments(KEY, state)
    patcher.set_injections(KEY, [PatcherInjection(inject=state.inject, eject=state.eject)])
    assert state.factors is not None  # set by RuntimeState.__post_init__
    patcher.set_additional_models(KEY, [state.factors.patcher_for(patcher)])
    patcher.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, KEY)
    if wrapper is not None:
        patcher.add_wrapper_with_key(WrappersMP.APPLY_MODEL, KEY, wrapper)


def entries_of(patcher) -> tuple[RuntimeEntry, ...]:
    """The entries an earlier loader left under KEY on `patcher` (none: an empty tuple)."""
    state = patcher.get_attachment(KEY) if hasattr(patcher, "get_attachment") else None
    return state.entries if isinstance(state, RuntimeState) else ()


def taken_names(model, clip=None) -> list[str]:
    """Names of the entries earlier loaders left on `model` (and `clip`), and of the adapters they hold."""
    entries = (*entries_of(model), *(entries_of(clip.patcher) if clip is not None else ()))
    return [name for e in entries for name in (e.name, *(a.name for a in e.plan.adapters))]


def unique_name(name: str, taken: Iterable[str]) -> str:
    """`name`, or `name#k` when `taken` holds it: gates and reports address entries by name."""
    names = set(taken)
    if name not in names:
        return name
    k = 2
    while f"{name}#{k}" in names:
        k += 1
    return f"{name}#{k}"


def stacked_clone(patcher, new: Sequence[RuntimeEntry], state: RuntimeState | None = None):
    """A clone of `patcher` whose KEY state holds the earlier entries plus `new` (the input is not modified);
    `state`, when given, is that state already built (a strength change).

    A clone inherits the input's `is_injected`; what is injected belongs to the input (possibly loaded right
    now), so the clone only forgets the flag: ComfyUI ejects the input when it loads the clone
    (load_models_gpu detaches the other clones of the model first)."""
    clone = patcher.clone()
    clone.is_injected = False
    state = state or RuntimeState((*entries_of(patcher), *new))
    has_gate = any(e.gate is not None for e in state.entries)
    install_state(clone, state, window_wrapper(state) if has_gate else None)
    return clone, state


def joint_plan(plans: Sequence[Plan]) -> Plan:
    """One plan holding every plan's adapters (once each), strengths and placed parts."""
    joint = Plan(plans[0].components, list({a.name: a for p in plans for a in p.adapters}.values()), {})
    joint.strengths = {k: v for p in plans for k, v in p.strengths.items()}
    joint.planned = [pp for plan in plans for pp in plan.planned]
    joint.params = [pp for plan in plans for pp in plan.params]
    return joint


def adapter_keys(adapter) -> list[str]:
    """Every key of `adapter`: its parts' keys and the keys no part took."""
    return [*(k for part in adapter.parts for k in part.keys), *(u["key"] for u in adapter.unparsed)]


def joint_misses(
    plans: Sequence[Plan], joint: Plan, accounted: set[tuple[str, str]], refused: list[Unmatched]
) -> list[Unmatched]:
    """Every key of the joint plan's adapters that is not `accounted` for (landed or skipped), named once: as
    refused, as some plan missed it, or as taken by no patcher given."""
    missed = {(u.adapter, u.key): u for u in refused}
    for u in (u for plan in plans for u in plan.unmatched):
        if (u.adapter, u.key) not in accounted:
            missed.setdefault((u.adapter, u.key), u)
    for adapter in joint.adapters:
        for key in adapter_keys(adapter):
            if (adapter.name, key) not in accounted:
                missed.setdefault((adapter.name, key), Unmatched(adapter.name, key, NOT_TAKEN))
    return list(missed.values())


def joint_report(
    plans: Sequence[Plan],
    mode: ApplyMode,
    applied: list[AppliedModule],
    refused: list[Unmatched],
    t0: float,
    model_only: bool,
) -> Report:
    """One report for adapters planned on several patchers (model, CLIP): a key landed when some plan placed
    it and nothing `refused` it afterwards; `model_only` (no CLIP given): the engine skips the text-encoder
    keys (engine/decide.py `skipped_keys`); every other key of each adapter is a miss, named once."""
    joint = joint_plan(plans)
    parts: list[PlannedPart | PlannedParam] = [*joint.planned, *joint.params]
    placed = {(pp.adapter.name, k) for pp in parts for k in pp.part.keys}
    landed = placed - {(u.adapter, u.key) for u in refused}
    skipped = skipped_keys(joint.adapters, model_only)
    accounted = landed | {(s.adapter, s.key) for s in skipped}
    report = make_report(joint, mode, applied, joint_misses(plans, joint, accounted, refused), t0, skipped)
    for summary in report.adapters:
        summary["keys_applied"] = sum(1 for a, _ in landed if a == summary["name"])
    report.keys_applied = sum(s["keys_applied"] for s in report.adapters)
    report.seconds = time.perf_counter() - t0
    return report


def entry_report(
    plans: Sequence[Plan], states: Sequence[RuntimeState], t0: float, model_only: bool
) -> Report:
    """The joint report of runtime entries: layers are the runtime paths that carry the plans' adapters;
    `model_only` as in joint_report."""
    names = {a.name for p in plans for a in p.adapters}
    applied = [
        AppliedModule(*_where(rp), "runtime", sorted(rp.adapters & names), cost="; ".join(sorted(rp.costs)))
        for state in states
        for rp in state.paths
        if rp.adapters & names
    ]
    refused = [u for st in states for u in st.blocked if u.adapter in names]
    return joint_report(plans, "runtime", applied, refused, t0, model_only)


def _where(rp: RuntimePath) -> tuple[str, str]:
    """(component, module path) of the layer a path sits on."""
    pp, piece = rp.contributions[0]
    return pp.component, piece.module


def apply_runtime(
    model,
    clip,
    adapter,
    strength_model: float,
    strength_clip: float,
    strict: bool = False,
    arch: ArchCheck = NO_ARCH_CHECK,
    modality_strengths: dict[str, float] | None = None,
):
    """(model, clip, report): clones carrying `adapter` as runtime paths (module docstring); inputs untouched.

    `adapter` is what `loraweave.comfy.api.read_lora` returns. `clip` may be None (then None comes back). The
    same inputs and adapter object again (a re-queued strength change) reuse the kept build's paths
    (requeue.py)."""
    from .requeue import Build, keep, kept_build, weak

    t0 = time.perf_counter()
    strengths = (float(strength_model), float(strength_clip))
    # a build with modality strengths is neither kept nor reused: its key does not hold them
    kept = None if modality_strengths else kept_build(model, clip, adapter, strict, entries_of)
    plans, states = (
        kept.restrengthened(strengths)
        if kept
        else _build(model, clip, adapter, strengths, strict, modality_strengths)
    )
    grown = grown_inputs(plans[0])  # a control adapter's input, at the width the engine allowed
    new_model, _ = stacked_clone(model, [], states[0])
    if grown:  # a control adapter's paths run on the wider input (add_patches re-rolls patches_uuid)
        new_model.add_patches(grow_patches(grown))
    new_clip = clip.clone() if clip is not None else None
    if len(states) > 1:  # a CLIP nothing lands on keeps no state of ours
        assert new_clip is not None  # a second state is the CLIP's
        new_clip.patcher, _ = stacked_clone(clip.patcher, [], states[1])
    report = entry_report(plans, states, t0, model_only=clip is None)
    plan_notes(report.applied, plans[0])
    note_rows(report.applied, plans[0])
    add_notes(report.applied, grown)
    refuse(report, strict, opt_ins=COMFY, arch=arch)
    note_other_arch(report, arch)
    if kept is None and not modality_strengths:
        keep(Build(weakref.ref(model), weak(clip), adapter, strict, plans, states))
    log.info("comfy runtime adapter=%s reused=%s", adapter.name, kept is not None)
    report.log()
    warn_incomplete(report)
    return new_model, new_clip, report


def _build(model, clip, adapter, strengths: tuple[float, float], strict: bool, modality_strengths=None):
    """(plans, states) planned and built anew: the model side, then the CLIP side when anything lands
    there."""
    from .targets import plan_for_clip, plan_for_patcher

    adapter = renamed(adapter, unique_name(adapter.name, taken_names(model, clip)))
    plans = [plan_for_patcher(model, adapter, strengths[0], strict, modality_strengths)]
    check_storage(plans[0])
    if clip is not None:
        plans.append(plan_for_clip(clip, adapter, strengths[1], strict))
    states = [RuntimeState((*entries_of(model), RuntimeEntry(adapter.name, plans[0])))]
    if clip is not None and plans[1].planned:
        states.append(RuntimeState((*entries_of(clip.patcher), RuntimeEntry(adapter.name, plans[1]))))
    return plans, states


def renamed(adapter, name: str):
    """A shallow copy of `adapter` named `name` (the caller's object is never renamed)."""
    if adapter.name == name:
        return adapter
    out = copy.copy(adapter)
    out.name = name
    return out
