"""AdapterSpec: one adapter to apply with its strengths and block weights (what `parse_prompt` returns)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from ..arguments import strength as check_strength
from ..errors import ArgumentError
from ..resolve.modality import check_modality_strengths
from ..resolve.schedule import check_window


@dataclass
class AdapterSpec:
    """An adapter source (path, Adapter or mapping) plus how strongly it applies.

    `strength` scales the denoiser; `te_strength` the text encoders (None: same as `strength`).
    `block_weights` is anything `loraweave.arch.blocks.block_weights` accepts (scalar, vector, dict, preset
    name); None means every block at 1. `name` is how reports and set_strength address it.
    `component_strengths` multiplies the strength per component, e.g. {"transformer": 1.0, "transformer_2":
    0.5} for Wan 2.2's two experts: the file's denoiser keys land on every denoiser named here (default: the
    pipeline's one denoiser). Text encoders named here are scaled likewise.

    `steps=(start, end)`: the adapter acts on the denoiser only on sampling steps i with start <= i/N < end
    (fractions of the N steps; `Handle.step_schedule`). `ramp="linear"` with `ramp_strengths=(first, last)`:
    the strength goes linearly from `first` on the window's first step to `last` on its last
    (mode="runtime").

    `modality_strengths` multiplies the strength per modality of an audio-video model (LTX-2/2.3,
    MiniMax-H3), e.g. {"video": 1.0, "audio": 0.0}: names "video", "audio", "cross" (cross-modal and joint
    modules); a modality left out stays at 1. Which module is which is declared by the architecture; on a
    model without modalities the request is refused (ArgumentError)."""

    source: str | os.PathLike | Any
    strength: float = 1.0
    te_strength: float | None = None
    block_weights: Any = None
    name: str | None = None
    component_strengths: dict[str, float] | None = None
    steps: tuple[float, float] | None = None
    ramp: str | None = None
    ramp_strengths: tuple[float, float] | None = None
    modality_strengths: dict[str, float] | None = None

    def __post_init__(self) -> None:
        check_window(self.steps, self.ramp, self.ramp_strengths)
        self.modality_strengths = check_modality_strengths(
            self.modality_strengths, "AdapterSpec modality_strengths"
        )
        for label, value in (("strength", self.strength), ("te_strength", self.te_strength)):
            if value is None and label == "te_strength":
                continue
            check_strength(value, f"AdapterSpec {label}")

        if self.component_strengths is not None and not isinstance(self.component_strengths, dict):
            raise ArgumentError(
                f"AdapterSpec component_strengths must be a dict, got {self.component_strengths!r}"
            )
        for component, value in (self.component_strengths or {}).items():
            if (
                not isinstance(component, str)
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ArgumentError(
                    f"AdapterSpec component_strengths must map component names to finite numbers, "
                    f"got {component!r}: {value!r}"
                )

    @property
    def text_encoder_strength(self) -> float:
        """The strength the text encoders get."""
        return float(self.strength if self.te_strength is None else self.te_strength)


def finite_strength(value: float, label: str = "strength") -> float:
    """A strength by AdapterSpec's rule (finite, |s| <= 1e4, not a string or bool); ArgumentError naming
    `label` otherwise."""
    return check_strength(value, label)
