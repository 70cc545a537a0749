"""Adapter families: one module each with the same shape, declared by its `SPEC` (a `base.Family`)."""

from __future__ import annotations

import torch

from . import boft, combined, dora, full, glora, ia3, loha, lokr, lora, norm, oft, peft_oft, replace_weight
from .base import Family

FAMILIES: dict[str, Family] = {
    m.SPEC.name: m.SPEC
    for m in (lora, full, loha, lokr, oft, boft, peft_oft, dora, ia3, norm, glora, replace_weight, combined)
}


def family_for(name: str, tensors: dict[str, torch.Tensor]) -> Family | None:
    """The family that lands a part filed under `name`, chosen from its keys and shapes: an "oft" part holding
    `oft_R` is PEFT OFT, one whose `oft_blocks` is 4-D is BOFT."""
    if name == "oft":
        if "oft_R" in tensors:
            return FAMILIES["peft_oft"]
        blocks = tensors.get("oft_blocks")
        if blocks is not None and blocks.dim() == 4:
            return FAMILIES["boft"]
    return FAMILIES.get(name)
