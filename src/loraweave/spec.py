"""AdapterSpec: one adapter to apply with its strengths and block weights (what `parse_prompt` returns)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any


@dataclass
class AdapterSpec:
    """An adapter source (path, Adapter or mapping) plus how strongly it applies.

    `strength` scales the denoiser; `te_strength` the text encoders (None: same as `strength`).
    `block_weights` is anything `loraweave.arch.blocks.block_weights` accepts (scalar, vector, dict, preset
    name); None means every block at 1. `name` is how reports and set_strength address it."""

    source: str | os.PathLike | Any
    strength: float = 1.0
    te_strength: float | None = None
    block_weights: Any = None
    name: str | None = None

    def __post_init__(self) -> None:
        for label, value in (("strength", self.strength), ("te_strength", self.te_strength)):
            if value is None and label == "te_strength":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"AdapterSpec {label} must be a finite number, got {value!r}")

    @property
    def text_encoder_strength(self) -> float:
        """The strength the text encoders get."""
        return float(self.strength if self.te_strength is None else self.te_strength)


def finite_strength(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"strength must be a finite number, got {value}")
    return value
