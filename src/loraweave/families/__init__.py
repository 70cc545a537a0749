"""Adapter families: one module each with the same shape (load, check_target, add_delta, runtime_term)."""

from . import full, lora

FAMILIES = {lora.FAMILY: lora, full.FAMILY: full}
