"""The ComfyUI we run inside, imported on first use only: `import loraweave.comfy` never imports ComfyUI.

Inside ComfyUI its packages (`comfy`, `comfy_api`, `folder_paths`) are already on sys.path; a script or test
puts the ComfyUI folder there first (tests/helpers/comfy_env.py)."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from ..errors import ComfyUnavailableError, TargetError


def comfy_module(name: str) -> ModuleType:
    """A ComfyUI module by dotted name (`comfy.model_patcher`), imported now; a typed error names what is
    missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ComfyUnavailableError(
            f"ComfyUI module {name!r} cannot be imported ({exc}); run inside ComfyUI or put its folder on "
            f"sys.path"
        ) from None


def weight_adapter_base() -> type:
    """ComfyUI's `WeightAdapterBase`: what `comfy.lora.calculate_weight` calls `calculate_weight` on."""
    return comfy_module("comfy.weight_adapter.base").WeightAdapterBase


def is_model_patcher(obj: object) -> bool:
    return isinstance(obj, comfy_module("comfy.model_patcher").ModelPatcher)


def is_clip(obj: object) -> bool:
    return isinstance(obj, comfy_module("comfy.sd").CLIP)


def diffusion_patcher(obj: object, field: str = "model"):
    """`obj` when it is a ComfyUI MODEL: a ModelPatcher over a model that has a `diffusion_model` module.
    Otherwise a TargetError naming the input `field` and what it got (what a miswired graph or another pack
    hands a node: a CLIP, a CLIP's own patcher, a bare BaseModel), before anything reads the object."""
    if not is_model_patcher(obj):
        got = "a CLIP (a CLIP output wired into a MODEL input?)" if is_clip(obj) else type(obj).__name__
        raise TargetError(f"input {field!r}: expected a ComfyUI MODEL (a ModelPatcher), got {got}")
    inner = getattr(obj, "model", None)
    if not isinstance(getattr(inner, "diffusion_model", None), torch.nn.Module):
        raise TargetError(
            f"input {field!r}: a ModelPatcher over {type(inner).__name__}, which has no diffusion_model: not "
            f"a "
            "diffusion MODEL (a CLIP's or another pack's patcher?)"
        )
    return obj
