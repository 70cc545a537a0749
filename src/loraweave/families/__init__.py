"""Adapter families: one module each with the same shape (load, check_target, add_delta, runtime_term)."""

from . import boft, combined, dora, full, glora, ia3, loha, lokr, lora, norm, oft, replace_weight

FAMILIES = {m.FAMILY: m for m in (lora, full, loha, lokr, oft, boft, dora, ia3, norm, glora, replace_weight, combined)}
