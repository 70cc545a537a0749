"""Errors of the diffusers drop-in: typed, and ValueError/NotImplementedError where diffusers raises those."""

from __future__ import annotations

from ..errors import LoraweaveError, TargetError


class DropInError(LoraweaveError, ValueError):
    """A call diffusers itself rejects with ValueError (same message), e.g. an adapter name already in use."""


class UnsupportedError(LoraweaveError, NotImplementedError):
    """A diffusers LoRA method the drop-in does not provide (hotswap, set_lora_device, ...)."""


class NotLoraPipelineError(TargetError):
    """enable() was given something that is not a diffusers pipeline with LoRA loading, or one holding PEFT
    layers."""
