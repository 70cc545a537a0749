"""loraweave inside ComfyUI: `load_lora_for_models` (the script API the nodes call) and, in sibling modules,
the nodes, the runtime path and the stack. Importing this package imports neither torch nor ComfyUI (PEP
562)."""

from __future__ import annotations

__all__ = ["conditioning_lora", "conditioning_runtime", "load_lora_for_models", "text_encode_lora"]


def __getattr__(name: str):
    if name == "load_lora_for_models":
        from .api import load_lora_for_models

        return load_lora_for_models
    if name in ("conditioning_lora", "conditioning_runtime", "text_encode_lora"):
        from . import conditioning

        return getattr(conditioning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
