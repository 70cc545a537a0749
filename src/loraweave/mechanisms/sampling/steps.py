"""Step windows at sampling time: a diffusers `callback_on_step_end` that sets each windowed adapter's
strength for the next step through the runtime scale update (no weight touched, no tensor allocated: the
per-rank scale vectors are rewritten in place, structured terms read the part strength at forward time).

Only the denoiser follows a window: text encoders run once before the first step and keep the adapter's
strength."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Protocol

from ...errors import ArgumentError
from ...resolve.planner import PlannedPart
from ...resolve.weights import AdapterWeights, is_text_encoder, part_strength
from ..runtime.path import RuntimePath


class Written(Protocol):
    """A layer whose weight holds adapter terms (a merge, a quantized write): which adapters."""

    @property
    def adapters(self) -> set[str] | frozenset[str]: ...


log = logging.getLogger("loraweave")


def check_total_steps(total_steps: int) -> None:
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ArgumentError(f"total_steps must be an int >= 1, got {total_steps!r}")


class StepSchedule:
    """Strength per step of each adapter with a window; call it as `callback_on_step_end`. Step 0 is set on
    creation, and the adapters' own strengths come back after the last step (or with `restore()`)."""

    def __init__(
        self,
        total_steps: int,
        settings: dict[str, AdapterWeights],
        planned: list[PlannedPart],
        paths: list[RuntimePath],
        written: Iterable[Written],
    ) -> None:
        """`settings`: the live AdapterWeights by adapter name; `planned`: every planned part; `paths`: the
        runtime paths; `written`: layers whose weights hold adapter terms (merged, quantized writes)."""
        check_total_steps(total_steps)
        windows = {name: w.window for name, w in settings.items() if w.window is not None}
        if not windows:
            raise ArgumentError(
                "no adapter has a step window: give AdapterSpec(..., steps=(start, end)) or a ramp"
            )
        merged = sorted({n for m in written for n in m.adapters} & set(windows))
        if merged:
            raise ArgumentError(
                f"step windows need runtime layers; {merged} are merged: apply with mode='runtime'"
            )
        self.total_steps = total_steps
        self._settings = settings
        self.table = {
            name: window.strengths(settings[name].strength, total_steps) for name, window in windows.items()
        }
        self._parts = {
            name: [pp for pp in planned if pp.adapter.name == name and not is_text_encoder(pp.component)]
            for name in windows
        }
        ids = {name: {id(pp) for pp in parts} for name, parts in self._parts.items()}
        self._paths = {
            name: [rp for rp in paths if any(id(pp) in ids[name] for pp, _ in rp.contributions)]
            for name in windows
        }
        self._current: dict[str, float | None] = dict.fromkeys(windows)
        self.apply(0)

    def apply(self, step: int) -> None:
        """Set every windowed adapter to its strength at `step` (steps past the end keep the last)."""
        step = min(max(step, 0), self.total_steps - 1)
        for name, values in self.table.items():
            self._set(name, values[step])

    def restore(self) -> None:
        """The adapters' own strengths again (as after apply)."""
        for name in self.table:
            self._set(name, self._settings[name].strength)

    def _set(self, name: str, value: float) -> None:
        if self._current[name] == value:
            return  # unchanged between steps: nothing rewritten
        w = self._settings[name]
        weights = replace(w, strength=value)  # block weights, component strengths and the rest stay
        for pp in self._parts[name]:
            pp.strength = part_strength(pp, weights)
        for rp in self._paths[name]:
            rp.refresh_scales()
        self._current[name] = value
        log.debug("step_schedule adapter=%s strength=%s", name, value)

    def __call__(
        self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """diffusers' callback_on_step_end: runs after step `step`, so it sets step + 1."""
        if step + 1 < self.total_steps:
            self.apply(step + 1)
        else:
            self.restore()
        return callback_kwargs
