"""PixArt-alpha/Sigma: diffusers names (the cross-attention DiT family's), named by the hidden width."""

from __future__ import annotations

from .record import Architecture, Skeleton

PIXART = Architecture(
    "pixart",
    skeleton=Skeleton(
        "transformer",
        "PixArtTransformer2DModel",
        {},
        {},
        "PixArtTransformer2DModel defaults (PixArt-alpha/Sigma: 28 blocks, hidden 1152)",
    ),
    cli_names=("pixart-sigma", "pixart-alpha"),
)
