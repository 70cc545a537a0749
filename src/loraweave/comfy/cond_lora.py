"""What a conditioning carries: its LoRA records under COND_KEY (conditioning.py attaches and reads them;
core_hooks.py makes them from core LoRA hooks)."""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.adapter import Adapter
from .steps import StepWindow

COND_KEY = "loraweave_loras"  # in a conditioning entry's dict: the CondLora records attached to it


@dataclass(frozen=True, eq=False)
class CondLora:
    """One LoRA attached to a conditioning: the parsed file, its strength, its step window (None: every
    step) and the name messages use. Compared by identity: a re-queued graph hands the same record."""

    adapter: Adapter
    strength: float
    window: StepWindow | None
    label: str
