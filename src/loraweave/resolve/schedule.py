"""Step windows and ramps: on which sampling steps an adapter acts on the denoiser, and how strongly.

A window (start, end) holds fractions of the schedule: with N steps, step i is inside when start <= i/N < end
(the rule of diffusers' `cutoff_step_ratio` and ComfyUI's start/end percent). A linear ramp goes from `first`
on the window's first step to `last` on its last one (a one-step window gets `first`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..arguments import number
from ..errors import ArgumentError

RAMPS = ("linear",)


@dataclass(frozen=True)
class StepWindow:
    start: float
    end: float
    ramp: tuple[float, float] | None = (
        None  # (first, last) strengths of a linear ramp; None: the adapter's strength
    )

    def strengths(self, strength: float, total: int) -> list[float]:
        """The adapter's strength on each of `total` steps (0 outside the window)."""
        inside = [i for i in range(total) if self.start <= i / total < self.end]
        values = [0.0] * total
        for k, i in enumerate(inside):
            if self.ramp is None:
                values[i] = strength
            else:
                first, last = self.ramp
                values[i] = first if len(inside) == 1 else first + (last - first) * k / (len(inside) - 1)
        return values


def _finite(value: object, what: str) -> float:
    return number(value, f"AdapterSpec {what}")


def _pair(value: object, what: str) -> tuple[float, float]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ArgumentError(f"AdapterSpec {what} must be a pair (start, end), got {value!r}")
    return _finite(value[0], what), _finite(value[1], what)


def check_window(
    steps: tuple[float, float] | None, ramp: str | None, ramp_strengths: tuple[float, float] | None
) -> None:
    """ArgumentError (a ValueError) unless the window is valid: 0 <= start < end <= 1; a ramp is 'linear' with
    two strengths."""
    if steps is not None:
        start, end = _pair(steps, "steps")
        if not 0.0 <= start < end <= 1.0:
            raise ArgumentError(f"AdapterSpec steps must satisfy 0 <= start < end <= 1, got {tuple(steps)}")
    if ramp is not None and ramp not in RAMPS:
        raise ArgumentError(f"AdapterSpec ramp must be one of {RAMPS} or None, got {ramp!r}")
    if ramp is not None and ramp_strengths is None:
        raise ArgumentError("AdapterSpec ramp='linear' needs ramp_strengths=(first, last)")
    if ramp_strengths is not None:
        if ramp is None:
            raise ArgumentError("AdapterSpec ramp_strengths needs ramp='linear'")
        _pair(ramp_strengths, "ramp_strengths")


def step_window(
    steps: tuple[float, float] | None,
    ramp: str | None,
    ramp_strengths: tuple[float, float] | None,
    factor: float = 1.0,
) -> StepWindow | None:
    """The window of a checked spec (ramp strengths times apply's `strength`), or None when it has none."""
    if steps is None and ramp is None:
        return None
    start, end = (float(steps[0]), float(steps[1])) if steps is not None else (0.0, 1.0)
    pair = None
    if ramp is not None and ramp_strengths is not None:  # checked: a ramp comes with its strengths
        pair = (float(ramp_strengths[0]) * factor, float(ramp_strengths[1]) * factor)
    return StepWindow(start, end, pair)
