"""What is checked before a merge writes anything: whether a layer can be merged exactly (merge_blocker,
needs_bias), apply's undo arguments (UndoSettings, undo_settings) and whether the merged values stay finite
(overflow_headroom, refuse_non_finite)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...errors import ArgumentError, NonFiniteResultError, UndoError
from ...families.contribution import bias_of
from ...modes import UNDO_KINDS, UndoKind
from ...resolve.stacking import Contribution
from .undo_source import SourceFiles, UndoSource


def merge_blocker(module: torch.nn.Module, needs_bias: bool = False) -> str | None:
    """Why merging into this module's weight would be lossy or impossible, or None when it is exact."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return "module has no weight"
    if needs_bias and getattr(module, "bias", None) is None:
        return "adapter carries a bias delta but the module has no bias"
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return f"weight is a {type(weight).__name__} (quantized or wrapped storage)"
    if not weight.is_floating_point():
        return f"weight dtype {weight.dtype} is not floating point"
    if weight.device.type == "meta":
        return "weight is offloaded (meta device)"
    if getattr(module, "_loraweave_streamed", False):
        return "layer is streamed (its weight is copied in per forward; merging would touch only the copy)"
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and (
        getattr(hook, "offload", False) or getattr(hook, "weights_map", None) is not None
    ):
        return "accelerate offload hook owns the weight"
    return None


def overflow_headroom(dtype: torch.dtype) -> float:
    """Half an ulp at the dtype's largest finite value: round-to-nearest of a finite x + d with |d| below it
    stays finite (the overflow threshold is max + ulp(max)/2); a quarter ulp is returned, as a margin."""
    info = torch.finfo(dtype)
    return math.ldexp(info.eps, math.frexp(info.max)[1] - 3)  # ulp(max) = eps · 2**(exponent of max)


def refuse_non_finite(written: torch.Tensor, original: torch.Tensor, adapters: set[str]) -> None:
    """Raise when the merge made values non-finite that were finite (an overflowing product of finite
    factors)."""
    try:
        lo, hi = torch.aminmax(written)
        if math.isfinite(lo.item()) and math.isfinite(hi.item()):
            return
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax here: the elementwise test below
        pass
    new = ~torch.isfinite(written.float()) & torch.isfinite(original.view_as(written).float())
    if bool(new.any()):
        raise NonFiniteResultError(
            f"merging {', '.join(sorted(adapters)) or 'the adapters'} gives {int(new.sum())} non-finite "
            f"values in a {tuple(written.shape)} {written.dtype} weight (the delta overflows); the layer is "
            f"left as it was"
        )


def needs_bias(contributions: list[Contribution]) -> bool:
    return any(bias_of(pp, piece) is not None for pp, piece in contributions)


@dataclass
class UndoSettings:
    """apply(undo=...): the record kind, where "source" records read from, and whether records may stay on the
    accelerator (never by default)."""

    kind: UndoKind = "auto"
    sources: SourceFiles | None = None
    on_device: bool = False


def check_undo_arguments(kind: UndoKind, source: UndoSource | None = None) -> None:
    if kind not in UNDO_KINDS:
        raise ArgumentError(f"undo must be one of {UNDO_KINDS}, got {kind!r}")
    if source is not None and kind != "source":
        raise ArgumentError(f"undo_source is read only with undo='source' (got undo={kind!r})")


def undo_settings(
    kind: UndoKind,
    components: dict[str, torch.nn.Module],
    source: UndoSource | None = None,
    on_device: bool = False,
) -> UndoSettings:
    """Check apply's undo arguments before anything is touched (a "source" with no file found is refused)."""
    check_undo_arguments(kind, source)
    sources = None
    if kind == "source":
        sources = SourceFiles(components, source)
        if not sources.found_any():
            where = (
                f"undo_source={source!r}"
                if source is not None
                else "config._name_or_path of "
                + ", ".join(
                    f"{c}={getattr(getattr(m, 'config', None), '_name_or_path', None)!r}"
                    for c, m in components.items()
                )
            )
            raise UndoError(
                f"undo='source' found no safetensors file to re-read weights from ({where}); pass "
                "undo_source=<file, directory or {component: path}> or use undo='auto'"
            )
    return UndoSettings(kind, sources, bool(on_device))
