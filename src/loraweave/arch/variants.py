"""Which released variant of an architecture an adapter file was trained on, from the file alone.

Block counts come from the highest block index per chain the file names (a file need not train every block, so
a variant fits when it has at least that many blocks; one with exactly that many is the likely one). The width
is the most common input width of the low-rank `down` factors, which for these transformers is the hidden
size."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from ..formats.adapter import Adapter
from ..formats.blocks import block_counts, block_indices
from . import registry
from .record import Release


@dataclass(frozen=True)
class Variant(Release):
    """A release of an architecture (its record's `releases`), named with the architecture it belongs to."""

    arch: str = ""


def variants() -> tuple[Variant, ...]:
    """Every release the registry's records declare, in registry order."""
    return tuple(Variant(**vars(r), arch=a.name) for a in registry.ARCHITECTURES for r in a.releases)


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


def _single_rows(adapter: Adapter, hidden: int | None, known: set[int | None]) -> int | None:
    """Rows of a fused single-block `linear1` per hidden unit, when the file has one and a release (`known`:
    the releases' ratios) has that ratio."""
    for p in adapter.parts:
        if hidden and "up" in p.roles and SINGLE_FUSED.search(p.path):
            rows, rest = divmod(adapter.shape(p.roles["up"])[0], hidden)
            return (
                rows if not rest and rows in known else None
            )  # another ratio (a hand-made file) says nothing
    return None


def related(release: Variant, arch: str) -> bool:
    """Whether a file detected as `arch` can be `release`: one of its own architecture's, or one that shares
    its block names (BFL-named Flux.1 / Flux.2). An SD1 UNet's `transformer_blocks.0` is no Flux double
    block."""
    if arch in (release.arch, release.catalog) or arch.startswith(release.arch):
        return True
    return any(arch.startswith(b) for b in BFL_NAMED) and release.arch in BFL_NAMED


def _takes(
    v: Variant, counts: dict[str, int], hidden: int | None, ratio: int | None, landed: str | None
) -> bool:
    """Whether release `v` can take a file with these block counts, `down` width and single-block ratio."""
    if not set(counts) <= set(v.chains) or any(n > v.chains[c] for c, n in counts.items()):
        return False
    if hidden is not None and hidden != v.hidden and landed != (v.catalog or v.arch):
        return False
    return ratio is None or v.single_rows in (None, ratio)


def _likely(fits: list[Variant], counts: dict[str, int]) -> Variant | None:
    """The one release with exactly the file's block counts, else the only one that fits, else None."""
    exact = [v for v in fits if v.chains == counts]
    if len(exact) == 1:
        return exact[0]
    return fits[0] if len(fits) == 1 else None


def variant_fit(adapter: Adapter, arch: str | None = None, landed: str | None = None) -> dict:
    """Block counts and width read from the file, the variants that can take it, and the likeliest one.

    arch: only releases `related` to it. landed: the architecture on whose full-size skeleton every key of the
    file lands; its own release then fits whatever the file's `down` widths are (a file that trains only the
    single blocks' out projection reads 5x the hidden width there, and the skeleton checked every shape)."""
    counts = block_counts([p.path for p in adapter.parts])
    hidden = _hidden(adapter)
    if not counts:
        return {"blocks": {}, "hidden": hidden, "fits": [], "likely": None, "catalog": None, "landed": None}
    releases = tuple(v for v in variants() if arch is None or related(v, arch))
    ratio = _single_rows(adapter, hidden, {v.single_rows for v in releases})
    fits = [v for v in releases if _takes(v, counts, hidden, ratio, landed)]
    likely = _likely(fits, counts)
    named = block_indices([p.path for p in adapter.parts])
    return {
        "blocks": counts,
        "named": {c: [found[0], found[-1], len(found)] for c, found in named.items()},  # [first, last, count]
        "hidden": hidden,
        "fits": [v.name for v in fits],
        "likely": likely.name if likely else None,
        "catalog": likely.catalog if likely else None,
        # said only when it named a release the width alone would not
        "landed": landed if any(hidden not in (None, v.hidden) for v in fits) else None,
    }
