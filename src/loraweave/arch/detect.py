"""Which architecture an adapter file was trained for, from its key names and shapes; the answer carries its
evidence. Metadata is reported but never trusted over the keys (a real Flux file says `sd_1.5`).

Every fact comes from the registry's records (arch/record.Architecture): `signature` (key names, matched in
underscore form so one pattern covers dotted, kohya and ComfyUI spellings; registry order = precedence, the
most specific first), `owners` (names several architectures share count for the owner whose own names the file
has), `widths` (shared names no owner claimed, told apart by a hidden width; the MMDiT and UNet families by
theirs, in their own steps below) and `depth` (architectures that share block names at one width, told apart
by how deep the file goes: the first whose block counts per chain hold the file's; a file that stops early
keeps the shallowest)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..formats.adapter import Adapter
from ..formats.blocks import highest_blocks
from . import registry
from .record import Architecture, Widths

METADATA_KEYS = ("modelspec.architecture", "ss_base_model_version", "ss_sd_model_name")


@dataclass
class Detection:
    architecture: str  # "unknown" when no signature matched
    evidence: list[str] = field(default_factory=list)
    scores: dict[str, int] = field(default_factory=dict)  # parts matched per architecture
    metadata: dict[str, str] = field(default_factory=dict)
    # The records whose own signatures some part matched, before shared names were folded: a file whose names
    # another architecture shares (their `owners`) may be that one's too (arch/fit.py).
    matched: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "architecture": self.architecture,
            "evidence": self.evidence,
            "scores": self.scores,
            "metadata": self.metadata,
        }


MMDIT, UNET = "mmdit", "unet"  # the families whose widths name a release in steps of their own


@dataclass(frozen=True)
class _Tables:
    signatures: tuple[tuple[str, str], ...]
    shared: dict[str, tuple[str, ...]]  # fold order: the most general names first, so owners fold last
    by_width: dict[str, Widths]
    by_depth: dict[str, tuple[tuple[str, dict[str, int]], ...]]
    family_widths: dict[str, Widths]


def _by_depth(archs: list[Architecture]) -> dict[str, tuple[tuple[str, dict[str, int]], ...]]:
    """{family: ((architecture, block counts), ...)} for families that name their own depth."""
    by_depth: dict[str, tuple[tuple[str, dict[str, int]], ...]] = {}
    for family in dict.fromkeys(a.depth[0] for a in archs if a.depth):
        rows = sorted(
            ((a.name, a.depth[1]) for a in archs if a.depth and a.depth[0] == family),
            key=lambda r: r[0] != family,
        )
        if rows[0][0] == family:  # the family's own depth first, then the deeper siblings in registry order
            by_depth[family] = tuple(rows)
    return by_depth


def _tables(archs: list[Architecture]) -> _Tables:
    return _Tables(
        tuple((a.name, a.signature) for a in archs if a.signature),
        {a.name: a.owners for a in reversed(archs) if a.owners},
        {a.name: a.widths for a in archs if a.owners and a.widths and a.name != MMDIT},
        _by_depth(archs),
        {a.name: a.widths for a in archs if a.name in (MMDIT, UNET) and a.widths},
    )


def _order(t: _Tables, arch: str) -> int:
    names = [s[0] for s in t.signatures]
    return names.index(arch) if arch in names else names.index(MMDIT)


def _family_kind(t: _Tables, family: str, adapter: Adapter, why: str) -> tuple[str, str] | None:
    """(release, evidence) a family's width names: the first part its pattern matches with a known width."""
    widths = t.family_widths.get(family)
    if widths is None:
        return None
    found = _width_of(adapter, widths.pattern, widths.names)
    return (widths.names[found[0]], f"{why} {found[0]} ({found[1]})") if found else None


def _mmdit_kind(t: _Tables, adapter: Adapter) -> tuple[str, str] | None:
    """SD3.5's dual attention (attn2 in a joint block), else the release the MMDiT family's width names."""
    widths = t.family_widths.get(MMDIT)
    for part in adapter.parts:
        path = part.path.replace(".", "_")
        if re.search(r"^transformer_blocks_\d+_attn2_", path):
            return "sd3", f"dual attention (attn2) in a joint block: SD3.5 ({part.stem})"
        if widths and re.search(widths.pattern, path) and "down" in part.roles:
            width = adapter.shape(part.roles["down"])[1]
            if width in widths.names:
                return widths.names[width], f"joint-block hidden width {width} ({part.stem})"
    return None


def _width_of(adapter: Adapter, pattern: str, known=None) -> tuple[int, str] | None:
    """(input width, part) of the first part whose path matches `pattern` and has a 2-D `down` factor (whose
    width is in `known`, when given)."""
    for part in adapter.parts:
        if re.search(pattern, part.path.replace(".", "_")) and "down" in part.roles:
            shape = adapter.shape(part.roles["down"])
            if len(shape) == 2 and (known is None or shape[1] in known):
                return int(shape[1]), part.stem
    return None


def _deeper(t: _Tables, adapter: Adapter, arch: str) -> tuple[str, str] | None:
    """(architecture, why) when the file indexes blocks `arch` does not have and a deeper sibling does."""
    tops = highest_blocks([p.path for p in adapter.parts])
    fits = [
        name
        for name, chains in t.by_depth[arch]
        if all(top < chains.get(c, 0) for c, (top, _) in tops.items())
    ]
    if not fits or fits[0] == arch:
        return None
    own = dict(t.by_depth[arch])[arch]
    chain, (top, at) = next((c, t) for c, t in tops.items() if t[0] >= own.get(c, 0))
    return fits[0], f"{chain}-stream block {top} ({adapter.parts[at].stem}): more blocks than {arch} has"


def _fold_shared(
    t: _Tables, adapter: Adapter, scores: dict[str, int], first: dict[str, str]
) -> list[tuple[str, str]]:
    """Shared names count for the owner whose own names the file has, else for the one their width names.
    Returns (architecture, why) for the evidence."""
    out = []
    for shared, owners in t.shared.items():
        owner = next((o for o in owners if o in scores), None)
        why = f"{shared} names shared with {owner}'s own names" if owner else ""
        if owner is None and shared in scores and shared in t.by_width:
            widths = t.by_width[shared]
            found = _width_of(adapter, widths.pattern)
            owner = widths.names.get(found[0]) if found else None
            why = f"hidden width {found[0]} ({found[1]})" if found else why
            other = _width_of(adapter, widths.same_width) if found and widths.same_width else None
            # e.g. Cosmos: 1024-wide text at 2048
            owner = None if other and found and other[0] != found[0] else owner
        if owner not in (None, shared) and shared in scores:
            _move(scores, first, shared, owner)
            out.append((owner, why))
    return out


def _move(scores: dict[str, int], first: dict[str, str], source: str, to: str) -> None:
    """Count `source`'s matched parts for `to` (its first example kept when `to` has one already)."""
    scores[to] = scores.get(to, 0) + scores.pop(source)
    first.setdefault(to, first.pop(source))


def _signature_scores(t: _Tables, adapter: Adapter) -> tuple[dict[str, int], dict[str, str]]:
    """(denoiser parts per architecture, by the first signature each matches; the first such part's stem)."""
    scores: dict[str, int] = {}
    first: dict[str, str] = {}
    for part in adapter.parts:
        if part.component != "denoiser":
            continue
        path = part.path.replace(".", "_")
        arch = next((arch for arch, pattern in t.signatures if re.search(pattern, path)), None)
        if arch is not None:
            scores[arch] = scores.get(arch, 0) + 1
            first.setdefault(arch, part.stem)
    return scores, first


def _fold_mmdit(
    t: _Tables, adapter: Adapter, scores: dict[str, int], first: dict[str, str]
) -> list[tuple[str, str]]:
    """MMDiT joint-block names count for the release a width fact names, then for the owners that names."""
    kind = _mmdit_kind(t, adapter)
    # Flux files also have single blocks; an SD3/Flux width fact decides where the shared names count.
    name = kind[0] if kind else ("flux" if "flux" in scores else "sd3-or-flux")
    _move(scores, first, MMDIT, name)
    return _fold_shared(t, adapter, scores, first)  # owners the width named


# What kohya / modelspec metadata values name (`sd_v1`, `v1-5-pruned-emaonly`, `sdxl_base_v1-0`,
# `stable-diffusion-xl-v1-base/lora`, `flux-1-dev/lora`), most specific first: `sdxl_base_v1-0` holds a `v1`.
METADATA_NAMES: tuple[tuple[str, str], ...] = (
    ("sdxl", r"sdxl|stable-diffusion-xl|\bxl[_-]"),
    ("sd3", r"sd3|stable-diffusion-3"),
    ("flux2", r"flux[._-]?2"),
    ("flux", r"flux"),
    ("sd2", r"sd[ _-]?v?2|stable-diffusion-v?2|\bv2[-_.]?[01]"),
    ("sd1", r"sd[ _-]?v?1|stable-diffusion-v?1|\bv1[-_.]?[45]"),
)


def metadata_architecture(meta: dict[str, str]) -> str | None:
    """The architecture the metadata values name (METADATA_NAMES), or None when they name none we know."""
    said = " ".join(meta.values()).lower()
    return next((arch for arch, rx in METADATA_NAMES if re.search(rx, said)), None)


def metadata_evidence(meta: dict[str, str], arch: str) -> str:
    """The evidence line for what the metadata says, against the architecture the keys and shapes found."""
    named = metadata_architecture(meta)
    if named is None:
        return f"metadata {meta} names no architecture loraweave reads from it"
    if arch == UNET:  # shapes decide which UNet (inspect's fit); the metadata line is redone then
        return f"metadata {meta} names {named}"
    agrees = arch == named or arch.startswith(named) or named.startswith(arch)
    return f"metadata {meta} names {named}: {'agrees' if agrees else 'disagrees; keys win'}"


def detect_architecture(adapter: Adapter) -> Detection:
    t = _tables(registry.ARCHITECTURES)
    scores, first = _signature_scores(t, adapter)
    meta = {k: adapter.metadata[k] for k in METADATA_KEYS if k in adapter.metadata}
    if not scores and any(p.layout == "cloneofsimo" for p in adapter.parts):
        return Detection("unet", ["cloneofsimo positional keys (unet:<i>): an SD1.x/SD2.x UNet"], {}, meta)
    if not scores:
        return Detection("unknown", ["no key matched a known architecture signature"], scores, meta)
    matched = tuple(scores)
    folded = _fold_shared(t, adapter, scores, first)
    if MMDIT in scores:
        folded += _fold_mmdit(t, adapter, scores, first)
    arch = max(scores, key=lambda a: (scores[a], -_order(t, a)))
    deeper = _deeper(t, adapter, arch) if arch in t.by_depth else None
    if deeper:
        _move(scores, first, arch, deeper[0])
        arch = deeper[0]
        folded.append(deeper)
    evidence = [f"{scores[arch]} of {len(adapter.parts)} parts match {arch} names, e.g. {first[arch]}"]
    joint = t.family_widths[MMDIT].names.values() if MMDIT in t.family_widths else ()
    if arch in (*joint, "sd3-or-flux") and (kind := _mmdit_kind(t, adapter)):
        evidence.append(kind[1])
    evidence += [why for owner, why in folded if owner == arch]
    if arch == UNET:
        kind = _family_kind(t, UNET, adapter, "cross-attention input width")
        if kind:
            arch = kind[0]
            evidence.append(kind[1])
    if meta:
        evidence.append(metadata_evidence(meta, arch))
    return Detection(arch, evidence, scores, meta, matched)
