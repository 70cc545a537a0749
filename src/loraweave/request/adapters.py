"""Checks on the list of adapters given to `apply`/`switch`: no empty sources, no explicit name used twice,
and a clear WARNING when one source is given more than once (its effects add up)."""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..errors import ArgumentError, ArgumentTypeError
from ..formats.adapter import Adapter
from .spec import AdapterSpec

log = logging.getLogger("loraweave")


def as_specs(adapters) -> list[AdapterSpec]:
    """What `apply`'s `adapters` may be (a path, Adapter, state dict, (source, strength), AdapterSpec, or a
    list of them) as AdapterSpecs, each strength checked by AdapterSpec's rule; ArgumentError for anything
    else."""
    if isinstance(adapters, (str, os.PathLike, Adapter, Mapping, AdapterSpec)) or (
        isinstance(adapters, tuple) and len(adapters) == 2 and isinstance(adapters[1], (int, float))
    ):
        adapters = [adapters]
    if adapters is None or not isinstance(adapters, Iterable):
        raise ArgumentError(
            f"adapters must be a path, Adapter, state dict, (source, strength) or AdapterSpec, "
            f"or a list of them; got {adapters!r}"
        )
    out = []
    for item in adapters:
        if isinstance(item, tuple):
            if len(item) != 2:
                raise ArgumentError(f"an adapter tuple is (source, strength), got {len(item)} items")
            item = AdapterSpec(item[0], item[1])
        spec = item if isinstance(item, AdapterSpec) else AdapterSpec(item)
        check_source(spec.source)
        out.append(spec)
    return out


def check_source(source: object) -> None:
    if source is None:
        raise ArgumentError("adapter source is None; expected a path, Adapter, state dict or AdapterSpec")
    if isinstance(source, (str, os.PathLike)) and not str(os.fspath(source)).strip():
        raise ArgumentError("adapter path is empty")
    if not isinstance(source, (str, os.PathLike, Adapter, Mapping)):
        raise ArgumentTypeError(
            f"adapters: a source must be a path, Adapter or state dict, got {type(source).__name__}"
        )


def _identity(source: object) -> tuple[str, str | int]:
    if isinstance(source, (str, os.PathLike)):
        try:
            return ("path", str(Path(source).resolve()))
        except OSError:
            return ("path", str(source))
    path = getattr(source, "path", None)
    return ("path", str(Path(path).resolve())) if isinstance(path, str) and path else ("object", id(source))


def check_names(specs) -> None:
    """Refuse an explicit `name` given twice; warn when one source appears more than once."""
    names = Counter(spec.name for spec, _ in specs if spec.name)
    twice = sorted(n for n, c in names.items() if c > 1)
    if twice:
        raise ArgumentError(
            f"adapter name(s) {', '.join(map(repr, twice))} given to more than one adapter; "
            "names address adapters in set_strength and the report, so each must be unique"
        )
    warn_repeated([(spec.source, weights.strength) for spec, weights in specs])


def warn_repeated(sources: Sequence[tuple[object, float]]) -> None:
    """A WARNING per source given more than once: each use applies it again, so the effects add up."""
    by_source: dict[tuple[str, str | int], list[float]] = {}
    for source, strength in sources:
        by_source.setdefault(_identity(source), []).append(strength)
    for (kind, ident), strengths in by_source.items():
        if len(strengths) > 1:
            shown = ident if kind == "path" else "one Adapter/state dict object"
            log.warning(
                "loraweave duplicate_adapter source=%s times=%d strengths=%s: their effects add up "
                "(total strength %g); pass it once with the summed strength if this is not intended",
                shown,
                len(strengths),
                strengths,
                sum(strengths),
            )
