"""Per-modality strengths of audio-video models (LTX-2/2.3, MiniMax-H3): one file trains both towers; a
request may scale its video, audio and cross-modal modules apart. Which module is which is declared by the
architecture (arch/record.py `Modalities`); a request on a model that declares none is refused."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from ..arch.record import MODALITIES, Modalities
from ..arch.registry import by_name, of_class
from ..arguments import strength as check_strength
from ..errors import ArgumentError


def check_modality_strengths(value: object, label: str) -> dict[str, float] | None:
    """{modality: finite strength} as given (None stays None); ArgumentError naming `label` and the entry."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ArgumentError(f"{label} must map modality names to strengths, got {value!r}")
    out = {}
    for name, scale in value.items():
        if name not in MODALITIES:
            raise ArgumentError(f"{label}: unknown modality {name!r}; known: {', '.join(MODALITIES)}")
        out[name] = check_strength(scale, f"{label}[{name!r}]")
    return out


def modality_request(
    video: float, audio: float, cross: float, label: str = "{}_strength"
) -> dict[str, float] | None:
    """The modality strengths of a face that always holds all three (ComfyUI's widgets, each named
    `label.format(modality)` in errors): None when every one is 1 (nothing asked, so a model without
    modalities takes the file), else all three."""
    given = {"video": video, "audio": audio, "cross": cross}
    wanted = {m: check_strength(v, label.format(m)) for m, v in given.items()}
    return None if all(v == 1.0 for v in wanted.values()) else wanted


def modalities_of(denoiser: object) -> Modalities | None:
    """The modality facet of the denoiser's architecture, None where it declares none."""
    return next((a.modalities for a in of_class(type(denoiser).__name__) if a.modalities), None)


def modality_of(modalities: Modalities, module: str) -> str:
    """The modality `module` (a live path under any non-text-encoder component) serves."""
    dotted = f".{module}"
    return next((m for m, rx in modalities.rules if re.search(rx, dotted)), modalities.default)


def modalities_for(denoiser: object, wanted: Mapping[str, float], label: str) -> Modalities:
    """The facet `wanted` scales on; ArgumentError naming `label` where the model declares no modalities."""
    found = modalities_of(denoiser)
    if found is None:
        raise ArgumentError(
            f"{label} {dict(wanted)!r}: the model ({type(denoiser).__name__}) has no modalities; they apply "
            "to audio-video models (LTX-2/2.3, MiniMax-H3)"
        )
    return found


def modalities_named(arch: str | None, wanted: Mapping[str, float], label: str) -> Modalities:
    """The facet of the architecture named `arch` (a host's model, ComfyUI's), as `modalities_for`."""
    record = by_name().get(arch) if arch is not None else None
    if record is None or record.modalities is None:
        what = (record.label or record.name) if record is not None else "not one loraweave maps"
        raise ArgumentError(
            f"{label} {dict(wanted)!r}: the model ({what}) has no modalities; they apply to audio-video "
            "models (LTX-2/2.3, MiniMax-H3)"
        )
    return record.modalities


def modality_scale(modalities: Modalities, module: str, wanted: Mapping[str, float]) -> tuple[str, float]:
    """(modality, its strength: 1 where `wanted` leaves it out)."""
    name = modality_of(modalities, module)
    scale = float(wanted.get(name, 1.0))
    assert math.isfinite(scale)  # checked where the request was made
    return name, scale
