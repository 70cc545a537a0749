"""Select modes for two adapters (subject, style): each layer runs one adapter per step, handed over once.

Per layer two scores are taken from the adapters' (scaled) dense deltas:
- klora: the sum of the K largest |Δ| with K = r_subject·r_style (the K-LoRA idea: the few largest entries
  say how much a layer matters to an adapter), balanced by ρ = Σ|Δ_subject| / Σ|Δ_style| over all layers;
- estlora: the energy ‖Δ‖², balanced by ρ = ΣS_subject / ΣS_style over all layers.
At step s of N (t = s/(N−1)) a layer belongs to the style adapter once
- klora:   S_style·ρ·(alpha·t + beta) > S_subject
- estlora: S_subject < (alpha·t + 1 − discrepancy)·S_style·ρ
and stays there: the ramp grows with t, and each layer flips at most once. Early steps (composition) keep the
subject; the style takes layers over as sampling proceeds. The diffusers callback runs at the end of step s
and sets the choices for step s+1, so a flip takes effect exactly at its step."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ..errors import ArgumentError
from .combine import SELECT_MODES

log = logging.getLogger("loraweave")

SUBJECT, STYLE = 0, 1


class LayerChooser(Protocol):
    def set_layer_choice(self, layer_key: str, index: int) -> None: ...


@dataclass(frozen=True)
class LayerScore:
    """One layer's scores for the subject (0) and style (1) adapter; `abs0/abs1` are Σ|Δ| (klora balance)."""

    s0: float
    s1: float
    abs0: float = 0.0
    abs1: float = 0.0


def layer_score(mode: str, delta0: Tensor | None, delta1: Tensor | None, k: int | None = None) -> LayerScore:
    """Score one layer from the two adapters' scaled dense deltas (None: that adapter does not touch it).

    klora needs `k` (r_subject·r_style); it is clamped to the number of entries."""
    if mode not in SELECT_MODES:
        raise ValueError(f"select mode must be one of {', '.join(SELECT_MODES)}, got {mode!r}")
    if mode == "klora" and (k is None or k < 1):
        raise ValueError(f"klora scores need k = r_subject·r_style >= 1, got {k!r}")

    def one(delta: Tensor | None) -> tuple[float, float]:
        if delta is None:
            return 0.0, 0.0
        flat = delta.detach().float().reshape(-1)
        total_abs = float(flat.abs().sum())
        if mode == "estlora":
            return float((flat * flat).sum()), total_abs
        assert k is not None  # klora: checked on entry
        top = torch.topk(flat.abs(), k=min(int(k), flat.numel()), largest=True).values
        return float(top.sum()), total_abs

    s0, a0 = one(delta0)
    s1, a1 = one(delta1)
    return LayerScore(s0, s1, a0, a1)


def lowrank_energy(up: Tensor, down: Tensor, scale: float = 1.0) -> float:
    """‖scale·up@down‖² from the factors alone: Σ (upᵀup) ⊙ (down downᵀ), no dense ΔW (estlora scores).

    `down` may carry conv kernel dims (r, in, *k); they are flattened into the input axis."""
    up2 = up.detach().float().reshape(up.shape[0], -1)
    down2 = down.detach().float().reshape(down.shape[0], -1)
    return float(scale) ** 2 * float(((up2.T @ up2) * (down2 @ down2.T)).sum())


class SelectSchedule:
    """Which adapter (0 = subject, 1 = style) each layer runs at each sampling step."""

    def __init__(
        self,
        mode: str,
        scores: Mapping[str, LayerScore],
        total_steps: int,
        *,
        alpha: float = 1.5,
        beta: float = 0.5,
        discrepancy: float = 0.5,
    ) -> None:
        if mode not in SELECT_MODES:
            raise ValueError(f"select mode must be one of {', '.join(SELECT_MODES)}, got {mode!r}")
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ArgumentError(f"total_steps must be a positive int, got {total_steps!r}")
        for name, value in (("alpha", alpha), ("beta", beta), ("discrepancy", discrepancy)):
            if not math.isfinite(float(value)):
                raise ArgumentError(f"{name} must be finite, got {value!r}")
        self.mode = mode
        self.total_steps = total_steps
        self.alpha, self.beta, self.discrepancy = float(alpha), float(beta), float(discrepancy)
        self.scores = dict(scores)
        self.balance = self._balance()
        self.flip_step: dict[str, int | None] = {key: self._first_flip(sc) for key, sc in self.scores.items()}
        flips = sum(v is not None for v in self.flip_step.values())
        log.info(
            "select_schedule mode=%s layers=%d steps=%d balance=%.6g flipping_layers=%d",
            mode,
            len(self.scores),
            total_steps,
            self.balance,
            flips,
        )

    @classmethod
    def from_deltas(
        cls,
        mode: str,
        deltas: Mapping[str, tuple[Tensor | None, Tensor | None]],
        total_steps: int,
        *,
        ranks: Mapping[str, tuple[int, int]] | tuple[int, int] | None = None,
        **kwargs: float,
    ) -> SelectSchedule:
        """Build from per-layer (subject ΔW, style ΔW); klora needs `ranks` (one pair, or one per layer)."""
        scores = {}
        for key, (d0, d1) in deltas.items():
            k = None
            if mode == "klora":
                if ranks is None:
                    raise ValueError("klora needs ranks=(r_subject, r_style) to size its top-K")
                r0, r1 = ranks if isinstance(ranks, tuple) else ranks[key]
                k = int(r0) * int(r1)
            scores[key] = layer_score(mode, d0, d1, k)
        return cls(mode, scores, total_steps, **kwargs)

    def _balance(self) -> float:
        if self.mode == "klora":
            num = sum(sc.abs0 for sc in self.scores.values())
            den = sum(sc.abs1 for sc in self.scores.values())
        else:
            num = sum(sc.s0 for sc in self.scores.values())
            den = sum(sc.s1 for sc in self.scores.values())
        # An all-zero side cannot be balanced against; leave the raw scores to decide.
        return num / den if num > 0 and den > 0 else 1.0

    def ramp_t(self, step: int) -> float:
        return step / (self.total_steps - 1) if self.total_steps > 1 else 0.0

    def _style_wins(self, sc: LayerScore, step: int) -> bool:
        t = self.ramp_t(step)
        if self.mode == "klora":
            return sc.s1 * self.balance * (self.alpha * t + self.beta) > sc.s0
        return sc.s0 < (self.alpha * t + 1.0 - self.discrepancy) * sc.s1 * self.balance

    def _first_flip(self, sc: LayerScore) -> int | None:
        for step in range(self.total_steps):
            if self._style_wins(sc, step):
                return step
        return None

    def active(self, layer_key: str, step: int) -> int:
        """0 (subject) or 1 (style) for `layer_key` at `step`; steps past the end keep the last choice."""
        if layer_key not in self.flip_step:
            raise KeyError(f"layer {layer_key!r} is not in this schedule")
        flip = self.flip_step[layer_key]
        return STYLE if flip is not None and step >= flip else SUBJECT

    def choices(self, step: int) -> dict[str, int]:
        return {key: self.active(key, step) for key in self.flip_step}

    def prime(self, handle_like: LayerChooser) -> None:
        """Set every layer's step-0 choice; call before sampling starts."""
        for key, index in self.choices(0).items():
            handle_like.set_layer_choice(key, index)

    def diffusers_callback(self, handle_like: LayerChooser) -> Callable[[Any, int, Any, dict], dict]:
        """A `callback_on_step_end(pipe, step, timestep, callback_kwargs)` that applies the step+1 choices.

        Only layers whose choice changes between step and step+1 are touched."""

        def callback(pipe: Any, step: int, timestep: Any, callback_kwargs: dict) -> dict:
            for key, flip in self.flip_step.items():
                if flip is not None and flip == step + 1:
                    handle_like.set_layer_choice(key, STYLE)
            return callback_kwargs

        return callback
