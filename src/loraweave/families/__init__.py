"""Adapter families: one module each with the same shape (load, check_target, add_delta, runtime_term)."""

from . import dora, full, loha, lokr, lora

FAMILIES = {m.FAMILY: m for m in (lora, full, loha, lokr, dora)}
