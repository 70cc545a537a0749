"""loraweave: apply LoRA/LyCORIS adapters to diffusion models, merged or at runtime, with a full report.

Names that need torch are imported on first use (PEP 562), so `import loraweave` and `loraweave inspect FILE`
without coverage start without loading torch."""

from importlib import import_module

from .errors import (
    AdapterFileError,
    AdapterFormatError,
    AdapterMetadataError,
    ArgumentError,
    ArgumentTypeError,
    BatchError,
    BudgetExceeded,
    BudgetTooSmall,
    CheckpointError,
    ComfyUnavailableError,
    ConvertError,
    DepthMismatchError,
    DropInError,
    EmptyOutputError,
    GenerateError,
    LoraweaveError,
    MergeError,
    NoKeysLandedError,
    NoModelToDrawOnError,
    NonFiniteResultError,
    NotLoraPipelineError,
    OtherInputError,
    PromptAdapterError,
    QuantizedLayoutError,
    QuantizedWeightError,
    RegionError,
    ServeRequestError,
    StateError,
    StrictApplyError,
    TargetError,
    UndoError,
    UnknownNameError,
    UnsafeFormatError,
    UnsupportedError,
    WriteError,
    WrongArchitectureError,
)
from .request.prompt import parse_prompt
from .request.spec import AdapterSpec


def _read_version() -> str:
    """The version is stated once, in pyproject.toml: read there in a source tree (a clone loaded as a ComfyUI
    custom node, an editable install), else from the installed distribution's metadata (built from it)."""
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "loraweave":
            return project["version"]
    from importlib.metadata import version

    return version("loraweave")


# public name -> module that defines it (imported when the name is first read)
_LAZY = {
    "Handle": ".api",
    "apply": ".api",
    "plan": ".api",
    "Adapter": ".formats.adapter",
    "AdapterPart": ".formats.adapter",
    "load_adapter": ".formats.adapter",
    "Report": ".report.report",
    "StreamHandle": ".streaming",
    "stream": ".streaming",
}


def __getattr__(name: str):
    if name == "__version__":
        globals()[name] = value = _read_version()
        return value
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later reads skip this function
        return value
    try:  # `loraweave.api` etc. without importing them first (they were imported eagerly before)
        return import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise  # the submodule exists but one of its own imports is missing
        raise AttributeError(f"module 'loraweave' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


__all__ = [
    "Adapter",
    "AdapterFileError",
    "AdapterFormatError",
    "AdapterMetadataError",
    "AdapterPart",
    "AdapterSpec",
    "ArgumentError",
    "ArgumentTypeError",
    "BatchError",
    "BudgetExceeded",
    "BudgetTooSmall",
    "CheckpointError",
    "ComfyUnavailableError",
    "ConvertError",
    "DepthMismatchError",
    "MergeError",
    "DropInError",
    "EmptyOutputError",
    "GenerateError",
    "Handle",
    "LoraweaveError",
    "NoKeysLandedError",
    "NoModelToDrawOnError",
    "NonFiniteResultError",
    "NotLoraPipelineError",
    "OtherInputError",
    "PromptAdapterError",
    "QuantizedLayoutError",
    "QuantizedWeightError",
    "RegionError",
    "Report",
    "ServeRequestError",
    "StateError",
    "StreamHandle",
    "StrictApplyError",
    "TargetError",
    "UndoError",
    "UnknownNameError",
    "UnsafeFormatError",
    "UnsupportedError",
    "WriteError",
    "WrongArchitectureError",
    "apply",
    "load_adapter",
    "parse_prompt",
    "plan",
    "stream",
]
