"""Loaded adapters and their resolution, kept per source so switching between sets re-plans nothing it saw.

A source is a file (keyed by its resolved path, size and modification time: an edited file is read again) or an
in-memory object (an Adapter or a state dict, keyed by identity and kept alive here; treat it as immutable
while a handle caches it)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..arch.aliases import AliasTable
from ..formats.adapter import Adapter, load_adapter
from .planner import Plan, resolve
from .target import Components


def source_key(source: object) -> tuple:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).resolve()
        try:
            st = path.stat()
            return ("file", str(path), st.st_size, st.st_mtime_ns)
        except OSError:
            return ("file", str(path))
    return ("object", id(source))


class ResolveCache:
    def __init__(self, components: Components, limit: int = 16) -> None:
        self.components = components
        self.tables = {name: AliasTable(module) for name, module in components}
        self.limit = limit  # adapters kept; the oldest is dropped first
        self._loaded: dict[tuple, tuple[object, Adapter]] = {}
        self._planned: dict[tuple, dict] = {}  # source key -> {expert set: plan}

    def load(self, source: object) -> Adapter:
        key = source_key(source)
        hit = self._loaded.pop(key, None)
        if hit is None:
            hit = (source, load_adapter(source))  # the source is held so an object's id stays unique
            self._planned.pop(key, None)
        self._loaded[key] = hit  # most recent last
        while len(self._loaded) > self.limit:
            old = next(iter(self._loaded))
            self._loaded.pop(old)
            self._planned.pop(old, None)
        return hit[1]

    def resolve(
        self,
        items: list[tuple[Adapter, float]],
        sources: list[object],
        experts: dict[str, tuple[str, ...]] | None = None,
    ) -> Plan:
        """Like plan.resolve.resolve, with each adapter's parts resolved once per source (and expert set)."""
        plan = Plan(self.components, [a for a, _ in items], {a.name: s for a, s in items})
        for (adapter, strength), source in zip(items, sources, strict=True):
            fan = (experts or {}).get(adapter.name)
            by_fan = self._planned.setdefault(source_key(source), {})
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
