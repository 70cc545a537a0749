"""Loaded adapters and their resolution, kept per source so switching between sets re-plans nothing it saw.

A source is a file (keyed by `io.file_cache.file_identity`: an edited file is read again; a PEFT directory is
read every time) or an in-memory object (an Adapter or a state dict, keyed by identity and kept alive here;
treat it as immutable while a handle caches it). Kept adapters are bounded by count and by file bytes."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from ..arch.aliases import AliasTable
from ..formats.adapter import Adapter, load_adapter
from ..io.file_cache import BYTES_KEPT, BoundedCache, file_identity
from .planner import Plan, resolve
from .target import Components

# What can be loaded: a path, an Adapter or a state dict.
Source = str | os.PathLike[str] | Mapping[str, torch.Tensor] | Adapter
# ("file", *FileIdentity) or ("object", id)
SourceKey = tuple[str | int, ...]


def source_key(source: object) -> SourceKey | None:
    """The cache key of a source: ("file", identity), ("object", id), or None for a path that is not one
    regular file (never kept)."""
    if isinstance(source, (str, os.PathLike)):
        identity = file_identity(Path(source))
        return None if identity is None else ("file", *identity)
    return ("object", id(source))


def _size(key: SourceKey) -> int:
    """The bytes a key stands for: a file's size (objects are the caller's, not counted)."""
    return int(key[4]) if key[0] == "file" else 0


@dataclasses.dataclass
class _Kept:
    """A kept source (held so an object's id stays unique), its adapter and its plans per expert set."""

    source: Source
    adapter: Adapter
    planned: dict[tuple[str, ...] | None, Plan] = dataclasses.field(default_factory=dict)


class ResolveCache:
    def __init__(self, components: Components, limit: int = 16, max_bytes: int = BYTES_KEPT) -> None:
        self.components = components
        self.tables = {name: AliasTable(module) for name, module in components}
        self.limit = limit  # adapters kept; the least recently used is dropped first
        # Plans live inside their source's entry, so the bound drops them with it (no callback back to
        # self: a cycle would keep every kept tensor alive until the cyclic collector runs).
        self._kept: BoundedCache[SourceKey, _Kept] = BoundedCache(limit, max_bytes)

    def load(self, source: Source) -> Adapter:
        key = source_key(source)
        hit = None if key is None else self._kept.get(key)
        if hit is None:
            adapter = load_adapter(source)
            if key is not None and source_key(source) == key:  # unchanged while it was read
                self._kept.put(key, _Kept(source, adapter), _size(key))
            return adapter
        return hit.adapter

    def resolve(
        self,
        items: list[tuple[Adapter, float]],
        sources: list[Source],
        experts: dict[str, tuple[str, ...]] | None = None,
    ) -> Plan:
        """Like plan.resolve.resolve, with each adapter's parts resolved once per source (and expert set)."""
        plan = Plan(self.components, [a for a, _ in items], {a.name: s for a, s in items})
        for (adapter, strength), source in zip(items, sources, strict=True):
            fan = (experts or {}).get(adapter.name)
            key = source_key(source)
            # a kept source is planned once per expert set
            kept = None if key is None else self._kept.get(key)
            by_fan = kept.planned if kept is not None else {}
            sub = by_fan.get(fan)
            if sub is None:
                sub = resolve(
                    self.components,
                    [(adapter, 1.0)],
                    tables=self.tables,
                    experts={adapter.name: fan} if fan else None,
                )
                by_fan[fan] = sub
            plan.planned += [
                dataclasses.replace(
                    pp, adapter=adapter, strength=strength, notes=list(pp.notes), grow=dict(pp.grow)
                )
                for pp in sub.planned
            ]
            plan.params += [
                dataclasses.replace(pp, adapter=adapter, strength=strength, notes=list(pp.notes))
                for pp in sub.params
            ]
            plan.unmatched += [dataclasses.replace(u, adapter=adapter.name) for u in sub.unmatched]
        return plan
