"""Per block × module kind ‖ΔW‖ (or energy share) of an adapter, on the architecture's own block order.

Every key is resolved against the full-size architecture (meta device, as `inspect` does) or a checkpoint's
shadow tree; each landed part gives ΔW at strength 1 (alpha/rank scale included) on its rows of its module.
A cell's value is sqrt(Σ‖ΔW‖²) over the modules in it ("norm") or Σ‖ΔW‖² / total ("energy"). Rows: the
block slots of `loraweave.arch.blocks` (BASE, IN00.., M00, OUT00.. on UNets; D00.., S00.. on Flux, ...), then
text-encoder layers; architectures without a slot table group by their first `name.N` container."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ArgumentError, NoModelToDrawOnError

log = logging.getLogger("loraweave")

METRICS = ("norm", "energy")
FORMED_BLOCK = 1 << 22  # ΔW elements formed at once (16 MiB fp32: under glibc's 32 MiB mmap ceiling, reused)
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|block)\.(\d+)\.")


@dataclass
class BlockGrid:
    """values[r][c] is None where no module of that kind in that block was touched."""

    file: str
    architecture: str
    metric: str
    rows: list[str]
    columns: list[str]
    values: list[list[float | None]]
    skipped: list[dict] = field(default_factory=list)  # {key, reason}: parts whose ΔW is not drawn

    def to_dict(self) -> dict:
        return {
            "file": self.file,
            "architecture": self.architecture,
            "metric": self.metric,
            "rows": self.rows,
            "columns": self.columns,
            "values": self.values,
            "skipped": self.skipped,
        }


def module_kind(path: str) -> str:
    """`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q` -> `attn1.to_q`; `...resnets.1.conv1` ->
    `conv1`: the path after its last container index, leading `name.N` wrappers dropped."""
    parts = path.split(".")
    numeric = [i for i, p in enumerate(parts) if p.isdigit()]
    cut = next((i for i in reversed(numeric) if len(parts) - i > 2), None)
    if cut is None:
        cut = next((i for i in reversed(numeric) if len(parts) - i > 1), -1)
    rest = parts[cut + 1 :]
    while len(rest) > 2 and rest[1].isdigit():
        rest = rest[2:]
    return ".".join(rest)


def _squared_norm(pp, piece, cols: int) -> float:
    """‖ΔW rows of `piece`‖² at strength 1: from the factors where the family gives the formula (LoRA through
    its factors' Gram matrices, LoKr through row norms); otherwise ΔW formed a bounded block of rows at a
    time, so no layer-sized tensor is allocated and freed per module."""
    f = pp.factors
    if pp.part.family == "lora" and getattr(f, "down", None) is not None:
        up = f.up[piece.src_start : piece.src_start + piece.length].double()
        down = f.down.flatten(1).double()
        sq = float(((up.T @ up) * (down @ down.T)).sum()) * pp.scale**2
        if f.up_bias is not None:
            sq += (
                float(f.up_bias[piece.src_start : piece.src_start + piece.length].double().square().sum())
                * pp.scale**2
            )
        return sq
    from_factors = pp.family.squared_norm(f, piece.src_start, piece.length)
    if from_factors is not None:
        return from_factors * pp.scale**2
    if pp.family.needs_base:
        raise ValueError(f"{pp.part.family} ΔW depends on the base weight")
    return _formed_squared_norm(pp, piece, cols)


def _formed_squared_norm(pp, piece, cols: int) -> float:
    """Σ‖ΔW rows‖² over blocks of at most FORMED_BLOCK elements, formed in one reused fp32 buffer."""
    import dataclasses

    import torch

    from ..families.contribution import add_contribution

    step = max(1, min(piece.length, FORMED_BLOCK // max(cols, 1)))
    buffer = torch.empty(step, cols, dtype=torch.float32)
    sq = 0.0
    for start in range(0, piece.length, step):
        n = min(step, piece.length - start)
        rows = dataclasses.replace(
            piece,
            src_start=piece.src_start + start,
            dst_start=piece.dst_start + start,
            length=n,
            whole=piece.whole and n == piece.length,
        )
        block = buffer[:n].zero_()
        add_contribution(block, pp, rows, None, coeff=pp.scale)
        sq += float(torch.linalg.vector_norm(block, dtype=torch.float64) ** 2)
    return sq


def _cols(module) -> int:
    import math

    weight = getattr(module, "weight", None)
    if weight is None:
        raise ValueError(f"{type(module).__name__} has no weight")
    return math.prod(weight.shape[1:]) if weight.dim() > 1 else 1


def _row_of(component: str, path: str, denoiser: str | None, slots: dict[str, str | None]) -> str:
    if component == denoiser and (slot := slots.get(path)):
        return slot
    if component != denoiser:
        m = _LAYER.search("." + path + ".")
        return f"{component}.L{int(m.group(1)):02d}" if m else f"{component}.other"
    m = re.match(r"^(.*?\.\d+)(\.|$)", path)  # no slot table: the first indexed container
    return m.group(1) if m else "BASE"


def _row_order(components, denoiser: str | None, arch: str | None, used: set[str]) -> list[str]:
    """Slots in the architecture's order (every slot, so untouched blocks show), then the other rows in module
    order (text-encoder layers, containers of slot-less architectures)."""
    from ..arch.blocks import chain_lengths, slot_names

    order: list[str] = []
    if arch is not None and denoiser is not None:
        names = [n for n, _ in components.modules[denoiser].named_modules()]
        order = slot_names(arch, chain_lengths(arch, names) or None)
    for comp, model in components.modules.items():
        slots: dict[str, str | None] = {}
        for name, _ in model.named_modules():
            row = _row_of(comp, name, denoiser, slots)
            if row in used and row not in order:
                order.append(row)
    return order + sorted(used - set(order))


def _components(adapter, arch: str | None, model: str | None, text_encoders: bool):
    """(Components, architecture name) the adapter resolves against, as `inspect` chooses them."""
    from ..resolve.target import as_components
    from .target import adapter_target

    components, against, detected = adapter_target(adapter, arch, model, text_encoders)
    if components is None:
        raise NoModelToDrawOnError(f"{adapter.name}: no heatmap: {against}")
    name = arch or (detected if model is None else "checkpoint")
    return as_components(components), name


def _module_energies(plan, components) -> tuple[dict[tuple[str, str], float], list[dict]]:
    """({(component, module): ‖ΔW‖² summed over the pieces landing there}, keys not drawn and why)."""
    per_module: dict[tuple[str, str], float] = {}
    skipped = [{"key": u["key"], "reason": u["reason"]} for u in plan.unmatched]
    for pp in plan.planned:
        for piece in pp.pieces:
            module = components.modules[pp.component].get_submodule(piece.module)
            try:
                sq = _squared_norm(pp, piece, _cols(module))
            except (ValueError, RuntimeError) as exc:
                skipped += [{"key": k, "reason": f"not drawn: {exc}"} for k in pp.part.keys]
                continue
            key = (pp.component, piece.module)
            per_module[key] = per_module.get(key, 0.0) + sq
    return per_module, skipped


def block_grid(
    path: str | Path,
    arch: str | None = None,
    model: str | None = None,
    metric: str = "norm",
    allow_pickle: bool = False,
    text_encoders: bool = True,
) -> BlockGrid:
    """The heatmap data of one adapter file (see the module docstring)."""
    from ..arch.blocks import block_arch_of, block_slots
    from ..arch.catalog import canonical
    from ..formats.adapter import load_adapter
    from ..resolve.planner import resolve

    if metric not in METRICS:
        raise ArgumentError(f"metric must be one of {METRICS}, got {metric!r}")
    adapter = load_adapter(path, allow_pickle=allow_pickle)
    components, name = _components(adapter, arch, model, text_encoders)
    plan = resolve(components, [(adapter, 1.0)])
    block_arch = block_arch_of(canonical(name)) if model is None else None
    denoiser = components.denoiser_name
    per_module, skipped = _module_energies(plan, components)
    den_paths = [p for c, p in per_module if c == denoiser]
    slots = block_slots(block_arch, den_paths) if block_arch else {}
    cells: dict[tuple[str, str], float] = {}
    for (comp, mpath), sq in per_module.items():
        cell = (_row_of(comp, mpath, denoiser, slots), module_kind(mpath))
        cells[cell] = cells.get(cell, 0.0) + sq
    rows = _row_order(components, denoiser, block_arch, {r for r, _ in cells})
    columns = _column_order(components, {k for _, k in cells})
    total = sum(cells.values()) or 1.0
    value = (lambda sq: sq**0.5) if metric == "norm" else (lambda sq: sq / total)
    values = [[value(cells[(r, c)]) if (r, c) in cells else None for c in columns] for r in rows]
    log.info(
        "plot file=%s arch=%s rows=%d columns=%d modules=%d skipped=%d",
        adapter.name,
        name,
        len(rows),
        len(columns),
        len(per_module),
        len(skipped),
    )
    return BlockGrid(str(path), name, metric, rows, columns, values, skipped)


def _column_order(components, kinds: set[str]) -> list[str]:
    """Module kinds in the order the model first uses them."""
    order: list[str] = []
    for model in components.modules.values():
        for name, _ in model.named_modules():
            kind = module_kind(name)
            if kind in kinds and kind not in order:
                order.append(kind)
    return order + sorted(kinds - set(order))
