"""Step windows inside ComfyUI: an adapter active from start_percent to end_percent of sampling, at runtime.

The adapter rides the runtime state of comfy/runtime.py (one injection key, no weight re-patched). An
APPLY_MODEL wrapper, which sees the sigma of every model call, writes the adapter's factor for that sigma into
its gates, i.e. into loraweave's per-rank scale vectors: nothing is re-merged, nothing re-cast.

The window follows ComfyUI's own start/end percent rule (ControlNet, hook keyframes): with
s_start = percent_to_sigma(start) and s_end = percent_to_sigma(end), a call at sigma is inside when
s_end < sigma <= s_start. With `ramp` > 0 the factor rises linearly from 0 at start_percent to 1 at
start_percent + ramp, and falls back to 0 at end_percent over the last `ramp` (both in sampling percent; the
percent of a sigma is found by bisection on percent_to_sigma, which is monotone)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ..arguments import number
from ..engine.decide import COMFY, check_strengths, note_other_arch, refuse
from ..errors import ArgumentError
from .runtime import (
    RuntimeEntry,
    entry_report,
    renamed,
    stacked_clone,
    taken_names,
    unique_name,
)

BISECTION_STEPS = 40  # percent resolution 2**-40: far below any sampler's step


@dataclass(frozen=True)
class StepWindow:
    """The gate of one windowed entry: factor of the adapter at a sigma, given the model's sampling."""

    start: float
    end: float
    ramp: float = 0.0

    def __call__(self, sigma: float, model_sampling) -> float:
        if (
            not model_sampling.percent_to_sigma(self.end)
            < sigma
            <= model_sampling.percent_to_sigma(self.start)
        ):
            return 0.0
        if self.ramp <= 0.0:
            return 1.0
        p = percent_of(sigma, model_sampling)
        return max(0.0, min(1.0, (p - self.start) / self.ramp, (self.end - p) / self.ramp))


def percent_of(sigma: float, model_sampling) -> float:
    """The sampling percent whose sigma is `sigma` (percent_to_sigma is decreasing in percent)."""
    lo, hi = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        if model_sampling.percent_to_sigma(mid) > sigma:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def check_window(start_percent, end_percent, ramp) -> StepWindow:
    start = number(start_percent, "start_percent")
    end = number(end_percent, "end_percent")
    ramp = number(ramp, "ramp")
    if not 0.0 <= start < end <= 1.0:
        raise ArgumentError(f"step window needs 0 <= start_percent < end_percent <= 1, got ({start}, {end})")
    if not 0.0 <= ramp <= (end - start) / 2 or not math.isfinite(ramp):
        raise ArgumentError(
            f"ramp must be in [0, (end_percent - start_percent) / 2] = [0, {(end - start) / 2}], got {ramp}"
        )
    return StepWindow(start, end, ramp)


def apply_step_window(
    model,
    lora,
    strength: float,
    start_percent: float,
    end_percent: float,
    ramp: float = 0.0,
    allow_other_arch: bool = False,
):
    """(model, report): a clone of `model` with `lora` (a path or a state dict) active only inside the window.

    Stacks with runtime loaders on the same model (one injection key); the input model is never modified. A
    file for another architecture is refused unless `allow_other_arch`, as `load_lora_for_models` refuses
    it."""
    from .api import file_arch_check, read_lora
    from .host import diffusion_patcher
    from .targets import plan_for_patcher

    diffusion_patcher(model)
    t0 = time.perf_counter()
    window = check_window(start_percent, end_percent, ramp)
    (strength,) = check_strengths(strength)
    adapter = read_lora(lora)
    arch = file_arch_check(model, [adapter], allow_other_arch)
    adapter = renamed(adapter, unique_name(adapter.name, taken_names(model)))
    plan = plan_for_patcher(model, adapter, strength, False)
    clone, state = stacked_clone(model, [RuntimeEntry(adapter.name, plan, window)])
    report = entry_report([plan], [state], t0, model_only=True)  # a MODEL only: text-encoder keys skipped
    refuse(report, False, opt_ins=COMFY, arch=arch)
    note_other_arch(report, arch)
    report.log()
    return clone, report
