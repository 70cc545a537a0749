"""Whether an adapter file is for the model it is applied to: the two facts the refusal of another
architecture's file compares (engine/decide.py `check_arch`), read from the registry's records.

The file's side is detection (arch/detect.py, what `inspect` shows), kept only where it names one concrete
model (a record with a catalog skeleton): "unknown" and a family detection could not narrow ("unet" without a
cross-attention key, "sd3-or-flux", "cross-dit") name none. What else the file may be is kept beside the name:
the architectures that own names it matched (an attention-only Qwen-Image LoRA reads as Flux by its width),
every release of a family whose width no part showed (a tiny or pruned model's file gets the family's
default), Flux.1 and Flux.2 for BFL names unless block counts and widths tell them apart.

The model's side is a record (ComfyUI: its supported_models class; diffusers: its class, the SD UNets told
apart by the cross-attention width read off the module) and the files it takes as its own: its own, those of
the records sharing its class that no width tells apart (flux-schnell and Flux.2 klein files detect as flux
and flux2), and its record's `takes` (derived models: Chroma takes Flux)."""

from __future__ import annotations

import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass

from ..formats.adapter import Adapter
from . import registry
from .detect import detect_architecture
from .record import Architecture, Widths
from .variants import variant_fit, variants

SPELLED = "FHLMNRSX"  # initials read as a letter name starting with a vowel sound: "an SD1.5", "an LTX-2"


@dataclass(frozen=True)
class FileArch:
    """What a file's keys and shapes say it was trained for: `name` (a concrete record) and every
    architecture whose model may own such names (`name` included)."""

    name: str
    possible: frozenset[str]


@dataclass(frozen=True)
class ModelArch:
    """What a model is: `name` (its record) and the file architectures it takes as its own."""

    name: str
    takes: frozenset[str]


def label(name: str) -> str:
    """What users call architecture `name` ("SD1.5", "Flux"): its record's label, else the name."""
    record = registry.by_name().get(name)
    return record.label if record is not None and record.label else name


def with_article(words: str) -> str:
    """`words` after "a" or "an" as it is read aloud: "an SD2", "a Flux", "an ERNIE-Image"."""
    spelled = len(words) > 1 and words[:2].isupper() and words[0] in SPELLED
    return f"{'an' if words[0] in 'AEIOU' or spelled else 'a'} {words}"


# file_arch per Adapter object (a ComfyUI re-queue passes the same one again): the registry's names it was
# computed under, a weak reference to the object (an id is reused once it is gone), the answer.
FILE_ARCHS_KEPT = 16
_file_archs: OrderedDict[int, tuple[tuple[str, ...], weakref.ref, FileArch | None]] = OrderedDict()


def file_arch(adapter: Adapter) -> FileArch | None:
    """The architecture `adapter` was trained for, where its keys and shapes name one; None otherwise. Kept
    per Adapter object: a re-queue of the same file asks again without reading its keys."""
    names = tuple(a.name for a in registry.ARCHITECTURES)
    kept = _file_archs.get(id(adapter))
    if kept is not None and kept[0] == names and kept[1]() is adapter:
        _file_archs.move_to_end(id(adapter))
        return kept[2]
    found = _file_arch(adapter)
    _file_archs[id(adapter)] = (names, weakref.ref(adapter), found)
    while len(_file_archs) > FILE_ARCHS_KEPT:
        _file_archs.popitem(last=False)
    return found


def _file_arch(adapter: Adapter) -> FileArch | None:
    detection = detect_architecture(adapter)
    name = detection.architecture
    possible = {name}
    if name == "flux":  # BFL names Flux.2 shares: its block counts and widths may name either
        possible = _bfl_releases(adapter)
        name = possible.pop() if len(possible) == 1 else name
        possible.add(name)
    by_name = registry.by_name()
    record = by_name.get(name)
    if record is None or record.skeleton is None:
        return None
    for matched in (by_name[m] for m in (*detection.matched, name) if m in by_name):
        possible |= set(matched.owners)
        if matched.widths is not None and not _width_found(adapter, matched.widths):
            possible |= set(matched.widths.names.values())  # no width spoke: a default named it
    return FileArch(name, frozenset(possible))


def _bfl_releases(adapter: Adapter) -> set[str]:
    """{flux}, {flux2} or both, by the releases the file's block counts and widths fit (both: none fits)."""
    fits = set(variant_fit(adapter, "flux")["fits"])
    return {v.arch for v in variants() if v.name in fits} or {"flux", "flux2"}


def _width_found(adapter: Adapter, widths: Widths) -> bool:
    """Whether some part the family's width pattern names has a `down` factor of one of its known widths."""
    pattern = re.compile(widths.pattern)
    for part in adapter.parts:
        if "down" in part.roles and pattern.search(part.path.replace(".", "_")):
            shape = adapter.shape(part.roles["down"])
            if len(shape) == 2 and shape[1] in widths.names:
                return True
    return False


def model_arch(name: str | None) -> ModelArch | None:
    """The model fact of registered architecture `name` (None: not one loraweave maps)."""
    record = registry.by_name().get(name) if name is not None else None
    if record is None:
        return None
    return ModelArch(record.name, frozenset({record.name, *_siblings(record), *record.takes}))


def _width_named() -> set[str]:
    return {n for a in registry.ARCHITECTURES if a.widths for n in a.widths.names.values()}


def _siblings(record: Architecture) -> set[str]:
    """Records of the same diffusers class that no width tells apart from `record`."""
    if record.skeleton is None:
        return set()
    named = _width_named()
    return {
        a.name
        for a in registry.ARCHITECTURES
        if a.skeleton is not None
        and a.skeleton.cls == record.skeleton.cls
        and not (a.name in named and record.name in named)
    }


def module_arch(module) -> ModelArch | None:
    """The model fact of a diffusers denoiser, or of a runtime's class its record's tables name (Nunchaku's);
    None: a class no record has, or a UNet whose cross-attention width names no release (a tiny test
    model)."""
    cls = type(module).__name__
    records = [a for a in registry.ARCHITECTURES if a.skeleton is not None and a.skeleton.cls == cls]
    # A runtime's own class (Nunchaku's) holding the architecture: the record whose tables name the class.
    records = records or [
        a
        for a in registry.ARCHITECTURES
        if a.skeleton is not None and any(cls in t.classes for t in a.tables)
    ]
    if len(records) > 1:
        by_width = _by_width(records, module)
        records = by_width if by_width is not None else _by_config(records, module)
    return model_arch(records[0].name) if records else None


def _by_width(records: list[Architecture], module) -> list[Architecture] | None:
    """The record a family's width names (read off the module's layers, as detection reads a file's), when
    every candidate is one of that family's releases ([] when the width names none of them); None when no
    family names them all."""
    names = {a.name for a in records}
    for family in registry.ARCHITECTURES:
        if family.widths is None or not names <= set(family.widths.names.values()):
            continue
        pattern = re.compile(family.widths.pattern)
        for path, layer in module.named_modules():
            width = getattr(layer, "in_features", None)
            if isinstance(width, int) and pattern.search(path.replace(".", "_")):
                found = family.widths.names.get(width)
                return [a for a in records if a.name == found]
        return []
    return None


def _by_config(records: list[Architecture], module) -> list[Architecture]:
    """The records ordered by how many of their skeleton's config entries the module's config holds."""
    config = getattr(module, "config", {}) or {}

    def agree(a: Architecture) -> int:
        assert a.skeleton is not None
        return sum(1 for k, v in a.skeleton.config.items() if _get(config, k) == v)

    return sorted(records, key=agree, reverse=True)


def _get(config, key: str):
    return config.get(key) if hasattr(config, "get") else getattr(config, key, None)
