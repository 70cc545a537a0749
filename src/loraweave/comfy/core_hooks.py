"""ComfyUI's own LoRA hooks (CreateHookLora / CreateHookLoraModelOnly, with Set Hook Keyframes) run as
conditioning LoRAs (comfy/conditioning.py): one batched forward, no weight patched per hook group.

Taken: a cond whose HookGroup holds only WeightHooks made from a LoRA state dict (`need_weight_init`: what
`create_hook_lora` makes). Each hook's keyframes become step windows: keyframe i holds from its start_percent
(the first one from the start, as ComfyUI makes the first keyframe current on reset) to the next one's, at
strength_model x its strength. ComfyUI's `guarantee_steps` (a keyframe kept for at least that many steps even
when the next one is already due) is not followed: with keyframes at least one step apart the result is the
same. Left to ComfyUI, the whole cond unchanged: a group holding any other hook (model-as-LoRA weights,
object patches, additional models, transformer options, injections)."""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

from .cond_lora import COND_KEY, CondLora
from .steps import StepWindow


def lora_hooks(group) -> list | None:
    """The hooks of `group` when every one is a LoRA weight hook on the model; None otherwise."""
    from comfy.hooks import WeightHook

    hooks = list(getattr(group, "hooks", None) or ())
    if not hooks or not all(type(h) is WeightHook and h.need_weight_init and h.weights for h in hooks):
        return None
    return hooks


def model_strength(hook) -> float:
    """The hook's strength_model without its keyframes (a clone with none: keyframe strength 1)."""
    from comfy.hooks import HookKeyframeGroup

    bare = hook.clone()
    bare.hook_keyframe = HookKeyframeGroup()
    return float(bare.strength_model)


def windows(hook) -> list[tuple[float, StepWindow | None]]:
    """(strength factor, window or None for every step) of each keyframe with a non-zero strength."""
    keyframes = list(hook.hook_keyframe.keyframes)
    if not keyframes:
        return [(1.0, None)]
    found: list[tuple[float, StepWindow | None]] = []
    for i, kf in enumerate(keyframes):
        start = 0.0 if i == 0 else float(kf.start_percent)
        end = float(keyframes[i + 1].start_percent) if i + 1 < len(keyframes) else 1.0
        if kf.strength != 0.0 and end > start:
            found.append((float(kf.strength), None if (start, end) == (0.0, 1.0) else StepWindow(start, end)))
    return found


class HookRecords:
    """CondLora records of core LoRA hooks, kept per (weights, strength, window): a re-queue hands the same
    records, so the model side reuses its build."""

    def __init__(self) -> None:
        self.kept: dict[tuple, tuple[dict, CondLora]] = {}

    def records(self, hook) -> list[CondLora]:
        from .api import read_lora

        out = []
        strength = model_strength(hook)
        for factor, window in windows(hook):
            span = (window.start, window.end) if window is not None else None
            key = (id(hook.weights), strength * factor, span)
            if key not in self.kept:
                record = CondLora(read_lora(hook.weights), strength * factor, window, "core hook LoRA")
                self.kept[key] = (hook.weights, record)
            out.append(self.kept[key][1])
        return out

    def convert(self, conds: Iterable[Iterable[MutableMapping]]) -> int:
        """Move every LoRA-only hook group of `conds` (the guider's per-run copies) to conditioning LoRAs;
        returns how many conds were converted."""
        done = 0
        for cond in conds:
            for entry in cond or ():
                hooks = lora_hooks(entry.get("hooks"))
                if hooks is None:
                    continue
                mine = [r for hook in hooks for r in self.records(hook)]
                entry[COND_KEY] = (*entry.get(COND_KEY, ()), *mine)
                del entry["hooks"]
                done += 1
        return done
