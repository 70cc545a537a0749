"""HunyuanVideo transformer: original / diffusion-pipe names -> diffusers HunyuanVideoTransformer3DModel modules."""

from __future__ import annotations

from .spec import ArchTable

HUNYUAN_VIDEO = ArchTable(name="hunyuan-video", classes=("HunyuanVideoTransformer3DModel",), aliases=())
