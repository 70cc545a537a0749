"""Flux.2 transformer: BFL/ComfyUI original names -> diffusers Flux2Transformer2DModel modules."""

from __future__ import annotations

from .spec import ArchTable

FLUX2 = ArchTable(name="flux2", classes=("Flux2Transformer2DModel",), aliases=())
