"""Typed errors raised by loraweave; every one names the file or key it is about."""

from __future__ import annotations


class LoraweaveError(Exception):
    """Base class of every error loraweave raises on purpose."""


class AdapterFileError(LoraweaveError):
    """The adapter file is malformed: bad header, bad ranges, unknown dtype, truncated data."""


class UnsafeFormatError(LoraweaveError):
    """The file is a pickle (.pt/.ckpt/.bin) and the caller did not opt in to reading it."""


class AdapterFormatError(LoraweaveError):
    """The tensors are readable but do not form an adapter we can interpret."""


class TargetError(LoraweaveError):
    """The apply target is not something we can resolve modules in."""


class StrictApplyError(LoraweaveError):
    """strict=True and some keys did not land; `.report` holds the full report."""

    def __init__(self, message: str, report) -> None:
        super().__init__(message)
        self.report = report


class NonFiniteResultError(LoraweaveError):
    """Finite factors whose merged result is not finite (the product overflows the weight's dtype); the layer is
    left as it was."""


class AdapterMetadataError(AdapterFormatError):
    """A metadata field (PEFT `lora_adapter_metadata`, kohya `ss_*`, cloneofsimo) is malformed; names file and field."""

    def __init__(self, source: str, field: str, why: str) -> None:
        super().__init__(f"{source}: metadata field {field!r} {why}")
        self.source, self.field = source, field


class UndoError(LoraweaveError):
    """A merge cannot be undone as recorded: its source file changed, or its record does not fit the weight."""
