"""Swap facets of registered architectures for one test (negative controls): the registry's records are
frozen, so a copy of the list with changed records replaces arch.registry.ARCHITECTURES until monkeypatch
undoes it."""

from __future__ import annotations

import dataclasses

from loraweave.arch import registry


def patch_records(monkeypatch, names, **changes) -> None:
    """Records named in `names` (all records when None) get `changes` (dataclasses.replace fields)."""
    records = [
        dataclasses.replace(r, **changes) if names is None or r.name in names else r
        for r in registry.ARCHITECTURES
    ]
    monkeypatch.setattr(registry, "ARCHITECTURES", records)
