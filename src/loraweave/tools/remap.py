"""Original (BFL / ldm / ComfyUI) names <-> live diffusers modules, row by row, for whole checkpoints and
adapters.

`original_spans` inverts the architecture alias tables: for each live module, which original tensor rows hold
it. `reference_for` recognises a checkpoint written in original names (a single-file Flux or SD checkpoint),
and gives the diffusers module tree to resolve adapters against, plus the spans to write the merged rows back;
a bare file in diffusers names with no config gets its catalog tree (and no spans), so original-named adapters
land on it too."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Collection
from pathlib import Path

import torch

from ..arch.aliases import original_names
from ..arch.registry import arch_tables
from ..arch.spec import Piece, apply_renames, out_rows

log = logging.getLogger("loraweave")
Spans = dict[
    str, list[tuple[str, int, int, int]]
]  # live module -> [(original, original row, module row, rows)]


def _renamed_spans(module: torch.nn.Module, present: Collection[str]) -> dict[str, tuple[str, int]]:
    """{live module: (original name, rows)} for the `present` weights whose name reaches a live module by the
    class's rename rules (LTX-2's `patchify_proj` is `proj_in`); alias tables cover the rest."""
    modules = dict(module.named_modules())
    tables = [
        t for t in arch_tables() if type(module).__name__ in t.classes and (t.renames or t.prefix_renames)
    ]
    out: dict[str, tuple[str, int]] = {}
    for key in present:
        original = key.removesuffix(".weight")
        for table in tables if original != key else ():
            live = apply_renames(original, table.renames, table.prefix_renames)
            rows = out_rows(modules[live]) if live != original and live in modules else None
            if rows is not None:
                out.setdefault(live, (original, rows))
    return out


def original_spans(
    module: torch.nn.Module, present: Collection[str] = (), renamed: bool = False
) -> tuple[Spans, dict[str, int]]:
    """({live module: [(original name, original row start, module row start, length)]}, {original: rows}).

    A module named by several aliases keeps the first (the canonical spelling: `linear1` before
    `linear1_qkv`), the first whose `<name>.weight` is in `present` where one is (ComfyUI's own HunyuanVideo
    spelling `img_attn.qkv` on its model, where the Tencent `img_attn_qkv` comes first)."""
    out: Spans = {}
    totals: dict[str, int] = {}
    names = original_names(module, dict(module.named_modules()))
    order = sorted(names, key=lambda o: f"{o}.weight" not in present)  # stable: table order otherwise
    for original in order:
        pieces = names[original]
        if any(p.module in out and out[p.module][0][0] != original for p in pieces):
            continue
        for p in pieces:
            out.setdefault(p.module, []).append((original, p.src_start, p.dst_start, p.length))
        totals[original] = sum(p.length for p in pieces)
    if renamed:  # also the present names that the class's rename rules take to a module no alias claimed
        for live, (original, rows) in _renamed_spans(module, present).items():
            if live not in out:
                out[live] = [(original, 0, 0, rows)]
                totals[original] = rows
    return out, totals


def translate(piece: Piece, spans: Spans) -> list[Piece]:
    """A piece on a live module -> the same rows as pieces on original tensors (identity without spans)."""
    out = []
    for original, o_start, m_start, length in spans.get(piece.module, ()):
        lo, hi = max(piece.dst_start, m_start), min(piece.dst_start + piece.length, m_start + length)
        if lo < hi:
            out.append(
                Piece(
                    original, piece.src_start + lo - piece.dst_start, o_start + lo - m_start, hi - lo, False
                )
            )
    return out or [piece]


def _arch_from_names(names: set[str]) -> str | None:
    """Catalog architecture of an original-named checkpoint, from a few marker tensors."""
    if any(n.startswith("distilled_guidance_layer.") for n in names):
        return "chroma"
    if any(n.startswith("double_blocks.") for n in names) and any(
        n.startswith("single_blocks.") for n in names
    ):
        return "flux" if any(n.startswith("guidance_in.") for n in names) else "flux-schnell"
    if any(n.startswith("joint_blocks.") for n in names):
        return "sd3"
    if any(n.startswith("input_blocks.") for n in names):
        return "sdxl" if "label_emb.0.0.weight" in names else "sd1"
    return None


def _arch_from_diffusers_names(names: set[str]) -> tuple[str, ...]:
    """Catalog architectures a bare diffusers-named denoiser file may be, from a few marker tensors."""
    if "conv_in.weight" in names and any(n.startswith("down_blocks.") for n in names):
        return ("sd1", "sd2", "sdxl")
    if any(n.startswith("single_transformer_blocks.") for n in names):
        return ("flux", "flux-schnell")
    return ()


def _same_tree(ref: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Every parameter of `ref` is in the file under its own name with its shape."""
    params = dict(ref.named_parameters())
    return bool(params) and all(tuple(shapes.get(n, ())) == tuple(p.shape) for n, p in params.items())


def _diffusers_reference(shapes: dict[str, tuple[int, ...]]) -> tuple[torch.nn.Module, Spans] | None:
    """The catalog skeleton a bare diffusers-named file is, parameter for parameter, with no spans (its own
    names are the live ones): its class's alias tables then land files in original (ComfyUI, kohya) names
    too."""
    from .skeleton import skeleton

    for name in _arch_from_diffusers_names(set(shapes)):
        ref = next(iter(skeleton(name, text_encoders=False).values()))
        if _same_tree(ref, shapes):
            log.info("checkpoint diffusers_names reference=%s", name)
            return ref, {}
    return None


def _from_config(folder: Path) -> torch.nn.Module | None:
    config = folder / "config.json"
    if not config.exists():
        return None
    data = json.loads(config.read_text())
    cls_name = data.get("_class_name")
    if not cls_name:
        return None
    try:
        import diffusers
    except ImportError:  # optional extra: without it, only original names already in the file resolve
        return None
    cls = getattr(diffusers, cls_name, None)
    if cls is None:
        return None
    with torch.device("meta"):
        return cls.from_config({k: v for k, v in data.items() if not k.startswith("_")})


def original_fit(
    ref: torch.nn.Module, shapes: dict[str, tuple[int, ...]], renamed: bool = False
) -> tuple[Spans, int] | None:
    """Spans when at least half the reference's original names are present and every present one has the
    reference's rows and input width (1x1 conv and Linear count as the same width); `renamed`: as in
    original_spans."""
    spans, totals = original_spans(ref, shapes, renamed)
    present = [o for o in totals if f"{o}.weight" in shapes]
    if not totals or len(present) < len(totals) / 2:
        return None
    cols: dict[str, int] = {}  # module -> input width
    for module, items in spans.items():
        weight = getattr(ref.get_submodule(module), "weight", None)
        if weight is not None:
            cols.setdefault(items[0][0], math.prod(weight.shape[1:]))
    for o in present:
        shape = shapes[f"{o}.weight"]
        if shape[0] != totals[o] or (o in cols and math.prod(shape[1:]) != cols[o]):
            return None
    return spans, len(present)


def reference_for(
    shapes: dict[str, tuple[int, ...]], folder: Path | None
) -> tuple[torch.nn.Module, Spans] | None:
    """(diffusers module tree, spans) when a single file's tensors use original names that a reference tree's
    alias tables know: the tree from a sibling config.json, else the catalog architecture the names point
    to."""
    candidates = []
    ref = _from_config(folder) if folder is not None else None
    if ref is not None:
        live = {n for n, _ in ref.named_parameters()}
        if len(live & set(shapes)) >= len(live) / 2:
            return None  # the file uses the config's own (diffusers) names; the shadow tree takes its class
        candidates.append(("config.json", ref))
    arch = _arch_from_names(set(shapes))
    if arch is None and not candidates:
        return _diffusers_reference(shapes)
    if arch is not None:
        from .skeleton import skeleton

        names = ("sd1", "sd2") if arch == "sd1" else (arch,)
        for name in names:
            comps = skeleton(name, text_encoders=False)
            candidates.append((name, next(iter(comps.values()))))
    for label, ref in candidates:
        fit = original_fit(ref, shapes)
        if fit is not None:
            log.info("checkpoint original_names reference=%s originals_present=%d", label, fit[1])
            return ref, fit[0]
    return None
