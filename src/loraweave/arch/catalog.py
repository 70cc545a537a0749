"""Architecture name -> full-size model skeleton on the `meta` device (no weights), for coverage checks.

Each architecture's record (arch/registry.py) carries its skeleton: a diffusers class plus the few config
numbers that set its shapes (taken from the released configs, else the class defaults), and the text encoders
a kohya file for that architecture may target (transformers config classes)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

import torch

from ..errors import ArgumentError
from . import registry
from .record import Skeleton

log = logging.getLogger("loraweave")


@dataclass(frozen=True)
class ArchEntry(Skeleton):
    """A catalog entry: an architecture's skeleton under its name."""

    name: str = ""


class _Catalog(Mapping):
    """Architecture name -> ArchEntry, read from the registry on every access (so a registered one is in
    it)."""

    def _entries(self) -> dict[str, ArchEntry]:
        return {
            a.name: ArchEntry(**{f.name: getattr(a.skeleton, f.name) for f in fields(Skeleton)}, name=a.name)
            for a in registry.ARCHITECTURES
            if a.skeleton is not None
        }

    def __getitem__(self, name: str) -> ArchEntry:
        return self._entries()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


CATALOG: Mapping[str, ArchEntry] = _Catalog()


def aliases() -> dict[str, str]:
    """Names detection or users may give -> catalog name (each architecture's `cli_names`)."""
    return {alias: a.name for a in registry.ARCHITECTURES for alias in a.cli_names}


def canonical(name: str) -> str:
    key = name.lower()
    key = aliases().get(key, key)
    if key not in CATALOG:
        raise ArgumentError(f"unknown architecture {name!r}; known: {', '.join(sorted(CATALOG))}")
    return key


def _build_text_encoder(cls_name: str, cfg: dict) -> torch.nn.Module:
    import transformers

    config_cls = {
        "CLIPTextModel": "CLIPTextConfig",
        "CLIPTextModelWithProjection": "CLIPTextConfig",
        "T5EncoderModel": "T5Config",
        "Qwen3Model": "Qwen3Config",
    }[cls_name]
    config = getattr(transformers, config_cls)(**cfg)
    return getattr(transformers, cls_name)(config)


def build_meta(name: str, text_encoders: bool = True) -> dict[str, torch.nn.Module]:
    """{component name: module on the meta device}; full size, no memory for weights."""
    try:
        import diffusers
    except ImportError as exc:  # an optional extra: say how to get it instead of a traceback
        raise ArgumentError(
            f"building the {name} architecture needs diffusers (pip install 'loraweave[diffusers]'); "
            "or pass --model CHECKPOINT"
        ) from exc

    entry = CATALOG[canonical(name)]
    t0 = time.perf_counter()
    out: dict[str, torch.nn.Module] = {}
    with torch.device("meta"):
        out[entry.denoiser] = getattr(diffusers, entry.cls).from_config(entry.config)
        for comp, (cls_name, cfg) in entry.components.items():
            out[comp] = getattr(diffusers, cls_name).from_config(cfg)
        if text_encoders:
            for comp, (cls_name, cfg) in entry.text_encoders.items():
                out[comp] = _build_text_encoder(cls_name, cfg)
    log.info(
        "catalog build arch=%s components=%s seconds=%.3f",
        entry.name,
        ",".join(out),
        time.perf_counter() - t0,
    )
    return out
