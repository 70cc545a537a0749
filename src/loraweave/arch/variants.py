"""Which released variant of an architecture an adapter file was trained on, from the file alone.

Block counts come from the highest block index per chain the file names (a file need not train every block, so
a variant fits when it has at least that many blocks; one with exactly that many is the likely one). The width is
the most common input width of the low-rank `down` factors, which for these transformers is the hidden size."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ..formats.adapter import Adapter
from ..formats.blocks import block_counts


@dataclass(frozen=True)
class Variant:
    arch: str
    name: str
    chains: dict[str, int]
    hidden: int
    # Rows of the single block's fused `linear1` per hidden unit: q|k|v + MLP (Flux.1, HunyuanVideo: 3 + 4;
    # Flux.2: 3 + 2 * 3, SwiGLU). Tells Flux.1 from Flux.2 files that share BFL names and a 3072 width.
    single_rows: int | None = None
    catalog: str | None = None  # the full-size skeleton of exactly this variant, when the catalog has one


# From the released configs (realdata/configs for Flux.1 and Wan). Flux.2: dev is diffusers' Flux2Transformer2DModel
# defaults; klein from the released transformer configs as DiffSynth-Studio's model_configs.py lists them
# (klein-4B: 5 double / 20 single blocks, 24 heads x 128; klein-9B: 8 / 24, 32 heads x 128).
VARIANTS: tuple[Variant, ...] = (
    Variant("flux", "flux1 (dev, schnell, Fill, Kontext)", {"double": 19, "single": 38}, 3072, 7),
    Variant("flux2", "flux2-dev", {"double": 8, "single": 48}, 6144, 9, "flux2"),
    Variant("flux2", "flux2-klein-9b", {"double": 8, "single": 24}, 4096, 9, "flux2-klein-9b"),
    Variant("flux2", "flux2-klein-4b", {"double": 5, "single": 20}, 3072, 9, "flux2-klein-4b"),
    Variant("wan", "wan-14b (2.1 T2V/I2V/FLF2V/VACE, 2.2 A14B/Animate)", {"blocks": 40}, 5120),
    Variant("wan", "wan-1.3b (2.1 T2V/VACE)", {"blocks": 30}, 1536),
    Variant("wan", "wan2.2-ti2v-5b", {"blocks": 30}, 3072),
    Variant("hunyuan-video", "hunyuan-video (T2V, I2V)", {"double": 20, "single": 40}, 3072, 7),
)
BFL_NAMED = (
    "flux",
    "flux2",
)  # architectures whose files share BFL block names (double_blocks / single_blocks)
SINGLE_FUSED = re.compile(r"(?:^|[._])single_blocks[._]\d+[._]linear1$|[._]to_qkv_mlp_proj$")


def _hidden(adapter: Adapter) -> int | None:
    widths = Counter(
        adapter.shape(p.roles["down"])[1]
        for p in adapter.parts
        if "down" in p.roles and len(adapter.shape(p.roles["down"])) == 2
    )
    return widths.most_common(1)[0][0] if widths else None


def _single_rows(adapter: Adapter, hidden: int | None) -> int | None:
    """Rows of a fused single-block `linear1` per hidden unit, when the file has one and a release has that ratio."""
    for p in adapter.parts:
        if hidden and "up" in p.roles and SINGLE_FUSED.search(p.path):
            rows, rest = divmod(adapter.shape(p.roles["up"])[0], hidden)
            known = {v.single_rows for v in VARIANTS}
            return (
                rows if not rest and rows in known else None
            )  # another ratio (a hand-made file) says nothing
    return None


def variant_fit(adapter: Adapter) -> dict:
    """Block counts and width read from the file, the variants that can take it, and the likeliest one."""
    counts = block_counts([p.path for p in adapter.parts])
    hidden = _hidden(adapter)
    if not counts:
        return {"blocks": {}, "hidden": hidden, "fits": [], "likely": None, "catalog": None}
    ratio = _single_rows(adapter, hidden)
    fits = [
        v
        for v in VARIANTS
        if set(counts) <= set(v.chains)
        and all(n <= v.chains[c] for c, n in counts.items())
        and (hidden is None or hidden == v.hidden)
        and (ratio is None or v.single_rows in (None, ratio))
    ]
    exact = [
        v for v in fits if all(v.chains[c] == n for c, n in counts.items()) and set(counts) == set(v.chains)
    ]
    likely = exact[0] if len(exact) == 1 else (fits[0] if len(fits) == 1 else None)
    return {
        "blocks": counts,
        "hidden": hidden,
        "fits": [v.name for v in fits],
        "likely": likely.name if likely else None,
        "catalog": likely.catalog if likely else None,
    }
