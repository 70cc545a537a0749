"""Krea2 transformer: original names -> diffusers Krea2Transformer2DModel modules."""

from __future__ import annotations

from .spec import ArchTable

KREA2 = ArchTable(name="krea2", classes=("Krea2Transformer2DModel",), aliases=())
