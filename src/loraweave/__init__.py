"""loraweave: apply LoRA/LyCORIS adapters to diffusion models, merged or at runtime, with a full report."""

from .api import Handle, apply, plan
from .errors import (
    AdapterFileError,
    AdapterFormatError,
    LoraweaveError,
    StrictApplyError,
    TargetError,
    UnsafeFormatError,
)
from .formats.adapter import Adapter, AdapterPart, load_adapter
from .report import Report

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "AdapterFileError",
    "AdapterFormatError",
    "AdapterPart",
    "Handle",
    "LoraweaveError",
    "Report",
    "StrictApplyError",
    "TargetError",
    "UnsafeFormatError",
    "apply",
    "load_adapter",
    "plan",
]
