"""Several adapters on one layer: dense combination modes (combine) and per-step layer selection (select)."""

from .combine import (
    DENSE_MODES,
    SELECT_MODES,
    STACK_MODES,
    combine_deltas,
    dare_masks,
    mask_seed,
    validate_stack,
)
from .select import LayerScore, SelectSchedule, layer_score, lowrank_energy

__all__ = [
    "DENSE_MODES",
    "SELECT_MODES",
    "STACK_MODES",
    "LayerScore",
    "SelectSchedule",
    "combine_deltas",
    "dare_masks",
    "layer_score",
    "lowrank_energy",
    "mask_seed",
    "validate_stack",
]
