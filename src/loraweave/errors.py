"""Typed errors raised by loraweave; every one names the file or key it is about."""

from __future__ import annotations


class LoraweaveError(Exception):
    """Base class of every error loraweave raises on purpose."""


class AdapterFileError(LoraweaveError):
    """The adapter file is malformed: bad header, bad ranges, unknown dtype, truncated data."""


class UnsafeFormatError(LoraweaveError):
    """The file is a pickle (.pt/.ckpt/.bin) and the caller did not opt in to reading it.

    The opt-in is `load_adapter(path, allow_pickle=True)` (then pass the Adapter on); the CLI's `--allow-pickle`."""

    def __init__(self, message: str, path=None) -> None:
        super().__init__(message)
        self.path = path


class AdapterFormatError(LoraweaveError):
    """The tensors are readable but do not form an adapter we can interpret."""


class TargetError(LoraweaveError):
    """The apply target is not something we can resolve modules in."""


class StrictApplyError(LoraweaveError):
    """strict=True and some keys did not land; `.report` holds the full report."""

    def __init__(self, message: str, report) -> None:
        super().__init__(message)
        self.report = report


class BatchError(LoraweaveError, ValueError):
    """A per-sample batch (`Handle.batch`) is malformed, or a layer's rows cannot be mapped to its samples."""


class RegionError(LoraweaveError, ValueError):
    """A regional mask (`Handle.set_region`) is malformed, or a layer's tokens cannot be placed on the image."""


class ArgumentError(LoraweaveError, ValueError):
    """An argument is out of range or of the wrong kind (strength, rank, energy, budget, adapter list)."""


class NoKeysLandedError(LoraweaveError):
    """Not one key of an adapter landed; nothing was changed. `.report` holds the full report.

    Pass `allow_empty=True` to `apply` to get a handle (and a WARNING) instead."""

    def __init__(self, message: str, report) -> None:
        super().__init__(message)
        self.report = report


class EmptyOutputError(LoraweaveError):
    """A tool would write an output with no effect (no key applied, no layer extracted); nothing was written.

    `.result` holds what the tool found; the CLI's `--allow-empty` (the tools' `allow_empty=True`) writes it."""

    def __init__(self, message: str, result=None) -> None:
        super().__init__(message)
        self.result = result


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
