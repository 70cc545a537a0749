"""The ComfyUI we run inside, imported on first use only: `import loraweave.comfy` never imports ComfyUI.

Inside ComfyUI its packages (`comfy`, `comfy_api`, `folder_paths`) are already on sys.path; a script or test
puts the ComfyUI folder there first (tests/helpers/comfy_env.py)."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import TargetError


class ComfyUnavailableError(TargetError):
    """ComfyUI's modules cannot be imported here (not inside ComfyUI, and its folder is not on sys.path)."""


def comfy_module(name: str) -> ModuleType:
    """A ComfyUI module by dotted name (`comfy.model_patcher`), imported now; a typed error names what is missing."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ComfyUnavailableError(
            f"ComfyUI module {name!r} cannot be imported ({exc}); run inside ComfyUI or put its folder on sys.path"
        ) from None


def weight_adapter_base() -> type:
    """ComfyUI's `WeightAdapterBase`: what `comfy.lora.calculate_weight` calls `calculate_weight` on."""
    return comfy_module("comfy.weight_adapter.base").WeightAdapterBase


def is_model_patcher(obj: object) -> bool:
    return isinstance(obj, comfy_module("comfy.model_patcher").ModelPatcher)


def is_clip(obj: object) -> bool:
    return isinstance(obj, comfy_module("comfy.sd").CLIP)
