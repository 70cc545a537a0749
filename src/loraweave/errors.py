"""Every typed error loraweave raises, in one family: each is a `LoraweaveError`, exported from `loraweave`,
and where callers catch a built-in (ValueError, TypeError, KeyError, RuntimeError, NotImplementedError) also a
subclass of it. Every message names the file, key or argument it is about."""

from __future__ import annotations


class LoraweaveError(Exception):
    """Base class of every error loraweave raises on purpose."""


class AdapterFileError(LoraweaveError):
    """The adapter file is malformed: bad header, bad ranges, unknown dtype, truncated data."""


class UnsafeFormatError(LoraweaveError):
    """The file is a pickle (.pt/.ckpt/.bin) and the caller did not opt in to reading it.

    The opt-in is `load_adapter(path, allow_pickle=True)` (then pass the Adapter on); the CLI's
    `--allow-pickle`."""

    def __init__(self, message: str, path=None) -> None:
        super().__init__(message)
        self.path = path


class AdapterFormatError(LoraweaveError):
    """The tensors are readable but do not form an adapter we can interpret."""


class TargetError(LoraweaveError):
    """The apply target is not something we can resolve modules in."""


class OtherInputError(TargetError):
    """An adapter was trained on inputs the model is not fed: its model-input key (Flux's `img_in`) takes a
    width the architecture does not relate to the model's (a Flux control LoRA on Flux Fill, whose extra
    columns would meet the masked image; on Chroma, which takes no control latent). Refused whatever
    `strict`, before anything changed; the message names each file and key. `.report` holds the report."""

    def __init__(self, message: str, report=None) -> None:
        super().__init__(message)
        self.report = report


class DepthMismatchError(TargetError, ValueError):
    """An adapter was trained on another depth of the model's block chain (an Anima 28-block LoRA on a
    52-block Anima-3.8B) and the architecture does not declare where that depth's blocks were inserted:
    they would land on the wrong ones. Refused whatever `strict`, before anything changed; `.adapter`,
    `.file_depth`, `.model_depth` and `.how` (where the file's depth was read) say which."""

    def __init__(
        self, adapter: str, file_depth: int, model_depth: int, how: str, known: list[tuple[int, int]]
    ) -> None:
        pairs = ", ".join(f"{a} -> {b}" for a, b in known) or "none"
        super().__init__(
            f"{adapter}: trained on {file_depth} blocks ({how}), the model has {model_depth}; where the "
            f"blocks of a {file_depth}-block file sit in a {model_depth}-block model is not known "
            f"(known: {pairs}), so it is refused rather than landed on the wrong blocks; nothing was changed"
        )
        self.adapter, self.file_depth, self.model_depth, self.how = adapter, file_depth, model_depth, how


class StrictApplyError(LoraweaveError):
    """strict=True and some keys did not land; `.report` holds the full report."""

    def __init__(self, message: str, report) -> None:
        super().__init__(message)
        self.report = report


class BatchError(LoraweaveError, ValueError):
    """A per-sample batch (`Handle.batch`) is malformed, or a layer's rows cannot be mapped to its samples."""


class RegionError(LoraweaveError, ValueError):
    """A regional mask (`Handle.set_region`) is malformed, or a layer's tokens cannot be placed on the
    image."""


class ArgumentError(LoraweaveError, ValueError):
    """An argument is out of range or of the wrong kind (strength, rank, energy, budget, adapter list)."""


class NoKeysLandedError(LoraweaveError):
    """Not one key of an adapter landed; nothing was changed. `.report` holds the full report.

    Pass `allow_empty=True` to `apply` to get a handle (and a WARNING) instead."""

    def __init__(self, message: str, report) -> None:
        super().__init__(message)
        self.report = report


class WrongArchitectureError(LoraweaveError):
    """An adapter file's keys and shapes say it was trained for another architecture than the model's (an SD2
    LoRA on an SD1.5 model) and some of its keys do not land; refused before anything changed. `.found` lists
    each such file (`adapter`, `file_arch`, `model_arch`, `words`), `.report` the full report.

    The opt-in is `allow_other_arch=True` (`apply`, `Handle.switch`, `loraweave.comfy.load_lora_for_models`),
    the nodes' `allow_other_arch` input, the CLI's `--allow-other-arch`; the report then says what was applied
    anyway."""

    def __init__(self, message: str, found: list[dict], report=None) -> None:
        super().__init__(message)
        self.found = found
        self.report = report


class EmptyOutputError(LoraweaveError):
    """A tool would write an output with no effect (no key applied, no layer extracted); nothing was written.

    `.result` holds what the tool found; the CLI's `--allow-empty` (the tools' `allow_empty=True`) writes
    it."""

    def __init__(self, message: str, result=None) -> None:
        super().__init__(message)
        self.result = result


class NonFiniteResultError(LoraweaveError):
    """Finite factors whose merged result is not finite (the product overflows the weight's dtype); the layer
    is left as it was."""


class AdapterMetadataError(AdapterFormatError):
    """A metadata field (PEFT `lora_adapter_metadata`, kohya `ss_*`, cloneofsimo) is malformed; names file and
    field."""

    def __init__(self, source: str, field: str, why: str) -> None:
        super().__init__(f"{source}: metadata field {field!r} {why}")
        self.source, self.field = source, field


class UndoError(LoraweaveError):
    """A merge cannot be undone as recorded: its source file changed, or its record does not fit the
    weight."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument is of the wrong kind (a string where a number goes, an object that is no adapter or
    model)."""


class UnknownNameError(ArgumentError, KeyError):
    """An argument names something the object does not hold (an adapter of a handle, a runtime layer)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class StateError(LoraweaveError, RuntimeError):
    """The call does not fit the object's state: a removed handle, a handle applied without the stack mode the
    call needs, merges a later apply merged again, a streamed model moved or run with autograd."""


class PromptAdapterError(LoraweaveError, ValueError):
    """A prompt tag names an adapter that cannot be used: bad syntax, unsafe or unknown name."""


class WriteError(LoraweaveError):
    """The output cannot be written where asked (it would overwrite an input, or it already exists)."""


class BudgetTooSmall(LoraweaveError, ValueError):
    """`stream`: the budget cannot hold the rest of the model plus the slots for the largest block."""


class BudgetExceeded(LoraweaveError, RuntimeError):
    """`stream`: a booking would take the streamer's device bytes past its budget (a planner bug, never
    expected)."""


class CheckpointError(LoraweaveError):
    """The model path is not a checkpoint layout bake/inspect can read."""


class ConvertError(LoraweaveError):
    """The target layout cannot express this adapter (or part of it); nothing was written."""


class MergeError(LoraweaveError):
    """Adapters that cannot be merged into one file (different architectures, incompatible shapes, a family
    that needs the base weight); the message names the file and key. Nothing is written."""


class GenerateError(LoraweaveError, ValueError):
    """A generate request that cannot run: bad argument, missing or unreadable model, failed sampling."""


class NoModelToDrawOnError(ArgumentError):
    """block_grid: the file resolves on no model (an architecture loraweave has no full-size model of, and no
    `arch` or `model` given), so there are no blocks to draw it on."""


class DropInError(LoraweaveError, ValueError):
    """diffusers drop-in: a call diffusers itself rejects with ValueError (same message), e.g. an adapter name
    already in use."""


class UnsupportedError(LoraweaveError, NotImplementedError):
    """diffusers drop-in: a diffusers LoRA method it does not provide (hotswap, set_lora_device, ...)."""


class NotLoraPipelineError(TargetError):
    """diffusers drop-in: enable() was given something that is not a diffusers pipeline with LoRA loading, or
    one holding PEFT layers."""


class ServeRequestError(LoraweaveError, ValueError):
    """A request the server refuses (HTTP 4xx): bad field, unknown adapter, a path outside the store, an
    adapter whose keys do not all land on this model."""


class ComfyUnavailableError(TargetError):
    """ComfyUI's modules cannot be imported here (not inside ComfyUI, and its folder is not on sys.path)."""


class QuantizedWeightError(TargetError, ValueError):
    """A quantized weight of the model is malformed: its stored bytes do not hold its declared type and
    shape (a GGUF tensor whose block count disagrees with its shape). Raised before anything changed; the
    message names the layer."""


class QuantizedLayoutError(QuantizedWeightError):
    """A layer's quantized weight is stored in a layout loraweave cannot read (a ComfyUI `comfy_quant` format
    whose comfy_kitchen layout is not registered); names the layer and the field. Nothing was changed."""
