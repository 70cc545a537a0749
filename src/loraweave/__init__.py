"""loraweave: apply LoRA/LyCORIS adapters to diffusion models, merged or at runtime, with a full report."""

from .api import Handle, apply, plan
from .errors import (
    AdapterFileError,
    AdapterFormatError,
    AdapterMetadataError,
    ArgumentError,
    EmptyOutputError,
    LoraweaveError,
    NoKeysLandedError,
    NonFiniteResultError,
    StrictApplyError,
    TargetError,
    UnsafeFormatError,
)
from .formats.adapter import Adapter, AdapterPart, load_adapter
from .prompt import PromptAdapterError, parse_prompt
from .report import Report
from .spec import AdapterSpec
from .streaming import StreamHandle, stream

__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "AdapterFileError",
    "AdapterFormatError",
    "AdapterMetadataError",
    "AdapterPart",
    "AdapterSpec",
    "ArgumentError",
    "EmptyOutputError",
    "Handle",
    "LoraweaveError",
    "NoKeysLandedError",
    "NonFiniteResultError",
    "PromptAdapterError",
    "Report",
    "StreamHandle",
    "StrictApplyError",
    "TargetError",
    "UnsafeFormatError",
    "apply",
    "load_adapter",
    "parse_prompt",
    "plan",
    "stream",
]
