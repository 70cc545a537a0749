"""LoRAs per conditioning inside ComfyUI, in the batches ComfyUI forms without hooks: no weight patched.

A conditioning carries its LoRAs under COND_KEY in each entry's dict (`conditioning_lora`, the node
LoraWeaveConditioningLoRA). ComfyUI copies that dict into every cond it samples (`convert_cond`, which also
gives each cond the `uuid` that `_calc_cond_batch` lists per batch chunk in `transformer_options["uuids"]`).

The model side (`conditioning_runtime`, node LoraWeaveConditioningRuntime) puts three things under KEY on a
clone of the MODEL; at sampling:
- OUTER_SAMPLE: read every LoRA the guider's conds carry, plan them on the model as runtime entries (with
  the entries earlier runtime loaders left: one RuntimeState, one rank-concatenated path per layer,
  comfy/runtime.py) and sample with a clone carrying that state (injection, factor model); each cond's uuid
  gets its sample key (the entries it uses and their strengths; a cond without LoRAs: the loaders' entries);
- APPLY_MODEL: map the call's rows to their conds' keys through `uuids` and hand them to loraweave's
  per-sample mix (mechanisms/sampling/mix.py), and set the step-window gates for the call's sigma.
Conds never carry hooks, so ComfyUI batches them as it batches LoRA-free conds (cond_or_uncond together,
regions together, same memory estimate) and `apply_hooks` patches nothing."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..engine.decide import COMFY, check_strengths, note_other_arch, refuse
from ..errors import ArgumentTypeError, LoraweaveError
from ..mechanisms.sampling.mix import Mix, mix_for, release
from ..mechanisms.sampling.persample import SampleKey
from ..report.report import Report
from ..resolve.weights import AdapterWeights
from .cond_lora import COND_KEY, CondLora
from .runtime import (
    RuntimeEntry,
    RuntimeState,
    entries_of,
    entry_report,
    install_state,
    renamed,
    taken_names,
    unique_name,
)
from .steps import StepWindow, check_window

log = logging.getLogger("loraweave")
KEY = "loraweave_conditioning"  # on a ModelPatcher: the attachment and the wrappers of the model side


def check_conditioning(conditioning: object) -> None:
    """ArgumentTypeError unless `conditioning` is a ComfyUI CONDITIONING (a list of [tensor, dict] pairs)."""
    ok = isinstance(conditioning, list) and all(
        isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], Mapping) for c in conditioning
    )
    if not ok:
        raise ArgumentTypeError(
            f"conditioning: expected a ComfyUI CONDITIONING (a list of [tensor, dict]), got "
            f"{type(conditioning).__name__}"
        )


def conditioning_lora(
    conditioning, lora, strength=1.0, start_percent=0.0, end_percent=1.0, label: str | None = None
) -> list:
    """A copy of `conditioning` whose every entry also carries `lora` (a path, a state dict or an Adapter) at
    `strength`, active from `start_percent` to `end_percent` of the sampling (ComfyUI's percent rule). The
    input is not modified. The MODEL it is sampled with needs `conditioning_runtime`."""
    check_conditioning(conditioning)
    (value,) = check_strengths(strength)
    window: StepWindow | None = check_window(start_percent, end_percent, 0.0)
    if window is not None and (window.start, window.end) == (0.0, 1.0):
        window = None  # every step: no gate to set
    from .api import read_lora

    adapter = read_lora(lora)
    item = CondLora(adapter, value, window, label or adapter.name)
    return [[t, {**d, COND_KEY: (*d.get(COND_KEY, ()), item)}] for t, d in conditioning]


def text_encode_lora(
    clip, text: str, lora, strength=1.0, strength_clip=1.0, start_percent=0.0, end_percent=1.0, label=None
) -> list:
    """`text` encoded as CLIPTextEncode encodes it, by a clone of `clip` with the text-encoder keys of `lora`
    merged at `strength_clip` (api.merge_clip), the result carrying `lora`'s denoiser part at `strength` as
    `conditioning_lora` attaches it: the LoRA acts on this conditioning's encode and samples only. The
    inputs are not modified."""
    from .api import merge_clip, read_lora

    check_strengths(strength)  # the denoiser part's checks before the encode
    check_window(start_percent, end_percent, 0.0)
    adapter = read_lora(lora)
    encoder, _ = merge_clip(clip, adapter, strength_clip)
    encoded = encoder.encode_from_tokens_scheduled(encoder.tokenize(text))
    return conditioning_lora(encoded, adapter, strength, start_percent, end_percent, label)


def requests_in(conds: Mapping[str, Iterable[Mapping]] | None) -> tuple[CondLora, ...]:
    """Every CondLora the guider's conds carry, once each, in the order met (positive first)."""
    found: dict[int, CondLora] = {}
    for cond in (conds or {}).values():
        for entry in cond or ():
            for item in entry.get(COND_KEY, ()):
                found.setdefault(id(item), item)
    return tuple(found.values())


@dataclass(eq=False)
class Built:
    """The runtime state built for one base patcher and one set of requests, and the clone carrying it."""

    base: weakref.ReferenceType
    requests: tuple[CondLora, ...]
    earlier: tuple[RuntimeEntry, ...]  # the entries runtime loaders left on the base
    names: dict[int, str]  # id(request) -> its entry's name
    state: RuntimeState
    clone: object
    report: Report

    def matches(self, base, requests: tuple[CondLora, ...]) -> bool:
        return (
            self.base() is base
            and len(requests) == len(self.requests)
            and all(a is b for a, b in zip(requests, self.requests, strict=True))
            and len(entries_of(base)) == len(self.earlier)
            and all(a is b for a, b in zip(entries_of(base), self.earlier, strict=True))
        )


class Batching:
    """One sampling run: the per-sample mix on the built state's paths and each cond's sample key."""

    def __init__(self, built: Built, conds: Mapping[str, Iterable[Mapping]]) -> None:
        self.state = built.state
        self.base_key: SampleKey = tuple((e.name, float(e.plan.strengths[e.name])) for e in built.earlier)
        self.keys_by_uuid: dict[object, SampleKey] = {}
        for cond in conds.values():
            for entry in cond or ():
                mine = tuple((built.names[id(r)], r.strength) for r in entry.get(COND_KEY, ()))
                self.keys_by_uuid[entry.get("uuid")] = self.base_key + mine
        strengths = {e.name: float(e.plan.strengths[e.name]) for e in self.state.entries}
        self.known = strengths
        settings = {name: AdapterWeights(s) for name, s in strengths.items()}
        roots = {c: m for e in self.state.entries for c, m in e.plan.components.modules.items()}
        names = {id(rp): ".".join(_where(rp)) for rp in self.state.paths}
        self.mix: Mix | None = mix_for(None, roots, names, self.state.paths, settings)
        self.keys: list[SampleKey] | None = None

    def prepare(self, rows: int, uuids, sigma: float, model_sampling) -> None:
        """Before one model call: gates for `sigma`, and the sample key of each of its `rows`."""
        assert self.mix is not None  # open until close()
        gates = dict(self.state.last_gates)
        self.state.set_gates(sigma, model_sampling)
        if uuids and rows % len(uuids) == 0:
            per = rows // len(uuids)
            keys = [self.keys_by_uuid.get(u, self.base_key) for u in uuids for _ in range(per)]
        else:  # a call ComfyUI's cond batching did not make: the loaders' entries only
            keys = [self.base_key] * rows
        if keys != self.keys or gates != self.state.last_gates:  # the mix caches per key and gate
            self.mix.clear_batch()
            self.mix.set_batch(
                [[n for n, _ in k] for k in keys], [[s for _, s in k] for k in keys], self.known
            )
            self.keys = keys

    def close(self) -> None:
        if self.mix is not None:
            self.mix.clear_batch()
            self.mix = release(self.mix, self.state.paths, active=False)


def _where(rp) -> tuple[str, str]:
    pp, piece = rp.contributions[0]
    return pp.component, piece.module


class ConditioningRuntime:
    """The model side's attachment (shared by the clones of the MODEL it is on): the last build and the run
    in flight."""

    def __init__(self, core_hooks: bool = False) -> None:
        self.built: Built | None = None
        self.running: Batching | None = None
        self.hooks = None
        if core_hooks:  # opt-in: core LoRA hooks run through this path too (comfy/core_hooks.py)
            from .core_hooks import HookRecords

            self.hooks = HookRecords()

    def on_model_patcher_clone(self) -> ConditioningRuntime:
        return self

    def build(self, base, requests: tuple[CondLora, ...]) -> Built:
        """The runtime state of `requests` on `base` (reused while both are the same); errors name the
        LoRA and leave `base` as it was."""
        if self.built is not None and self.built.matches(base, requests):
            return self.built
        from .api import file_arch_check
        from .targets import plan_for_patcher

        t0 = time.perf_counter()
        taken = taken_names(base)
        entries, names, plans = [], {}, []
        for r in requests:
            try:
                arch = file_arch_check(base, [r.adapter], False)
                name = unique_name(r.label, taken)
                taken.append(name)
                plan = plan_for_patcher(base, renamed(r.adapter, name), r.strength, False)
                report = entry_report([plan], [RuntimeState((RuntimeEntry(name, plan),))], t0, True)
                refuse(report, False, opt_ins=COMFY, arch=arch)
                note_other_arch(report, arch)
            except LoraweaveError as exc:
                if exc.args and isinstance(exc.args[0], str):
                    exc.args = (f"conditioning LoRA {r.label}: {exc.args[0]}", *exc.args[1:])
                raise
            entries.append(RuntimeEntry(name, plan, r.window))
            names[id(r)] = name
            plans.append(plan)
        earlier = entries_of(base)
        state = RuntimeState((*earlier, *entries))
        clone = base.clone()
        clone.is_injected = False  # what is injected belongs to the base (runtime.stacked_clone)
        install_state(clone, state)  # gates are set by this module's APPLY_MODEL wrapper
        report = entry_report(plans, [state], t0, model_only=True)
        report.log()
        log.info("comfy conditioning_loras=%d entries=%d", len(requests), len(state.entries))
        self.built = Built(weakref.ref(base), requests, earlier, names, state, clone, report)
        return self.built

    def outer_sample(self, executor, *args, **kwargs):
        """OUTER_SAMPLE wrapper: sample with the clone carrying the conds' LoRAs, then the base again."""
        guider = executor.class_obj
        if self.hooks is not None:
            converted = self.hooks.convert((guider.conds or {}).values())
            log.debug("comfy core_lora_hooks converted=%d", converted)
        requests = requests_in(guider.conds)
        if not requests:
            return executor(*args, **kwargs)
        base = guider.model_patcher
        built = self.build(base, requests)
        self.running = Batching(built, guider.conds)
        guider.model_patcher = built.clone
        try:
            return executor(*args, **kwargs)
        finally:
            guider.model_patcher = base
            running, self.running = self.running, None
            running.close()

    def apply_model(self, executor, x, t, *args, **kwargs):
        """APPLY_MODEL wrapper: the rows of this call mapped to their conds' adapter sets."""
        if self.running is not None:
            options = kwargs.get("transformer_options", args[3] if len(args) > 3 else None) or {}
            sampling = executor.class_obj.model_sampling
            self.running.prepare(x.shape[0], options.get("uuids"), float(t.reshape(-1)[0]), sampling)
        return executor(x, t, *args, **kwargs)


def conditioning_runtime(model, core_lora_hooks: bool = False):
    """A clone of `model` that runs the LoRAs its conditionings carry (`conditioning_lora`) in one batched
    forward at sampling; `core_lora_hooks`: also the conds' core LoRA hooks (comfy/core_hooks.py). The input
    is not modified."""
    from comfy.patcher_extension import WrappersMP

    from .host import diffusion_patcher

    diffusion_patcher(model)
    clone = model.clone()
    runtime = ConditioningRuntime(bool(core_lora_hooks))
    clone.set_attachments(KEY, runtime)
    wrappers = (
        (WrappersMP.OUTER_SAMPLE, runtime.outer_sample),
        (WrappersMP.APPLY_MODEL, runtime.apply_model),
    )
    for kind, fn in wrappers:
        clone.remove_wrappers_with_key(kind, KEY)
        clone.add_wrapper_with_key(kind, KEY, fn)
    return clone
