"""Swap facets of registered architectures for one test (negative controls): the registry's records are
frozen, so a copy of the list with changed records replaces arch.registry.ARCHITECTURES until monkeypatch
undoes it. Alias tables are facets too (arch.aliases reads them from the registry, arch.registry.arch_tables):
`patch_tables` changes them the same way."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from loraweave.arch import registry
from loraweave.arch.spec import ArchTable


def patch_records(monkeypatch, names, **changes) -> None:
    """Records named in `names` (all records when None) get `changes` (dataclasses.replace fields)."""
    records = [
        dataclasses.replace(r, **changes) if names is None or r.name in names else r
        for r in registry.ARCHITECTURES
    ]
    monkeypatch.setattr(registry, "ARCHITECTURES", records)


def patch_tables(monkeypatch, change: Callable[[ArchTable], ArchTable | None]) -> None:
    """Every alias table of every record becomes `change(table)` (None drops it), in place in its record."""
    records = [
        dataclasses.replace(r, tables=tuple(t for t in map(change, r.tables) if t is not None))
        if r.tables
        else r
        for r in registry.ARCHITECTURES
    ]
    monkeypatch.setattr(registry, "ARCHITECTURES", records)
