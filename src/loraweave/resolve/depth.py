"""Depth-expanded models: a file trained on one depth of a block chain meets a model of another (an Anima
28-block LoRA on the 40-block Anima-2.9B). The file's blocks are moved to the model's positions where the
architecture declares where the new blocks were inserted (arch/record.py `Depths`); any other pair of depths
is refused before anything changes, naming both. Never lands a file on blocks it was not trained for."""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
from dataclasses import dataclass

from ..arch.aliases import AliasTable
from ..arch.record import Depths
from ..arch.registry import of_class
from ..errors import AdapterMetadataError, DepthMismatchError
from ..formats.adapter import Adapter, AdapterPart
from ..formats.keys import DENOISER
from ..formats.metadata import kohya_args, kohya_number

log = logging.getLogger("loraweave")

# AnimaLoraStudio writes the base model's depth into ss_network_args (its PR #503).
METADATA_DEPTH = "base_num_blocks"


@dataclass(frozen=True)
class FileDepth:
    depth: int
    how: str  # where it was read, for messages: metadata field or highest block index


def depths_of(denoiser: object) -> Depths | None:
    """The depth facet of the denoiser's architecture, None where it declares none."""
    return next((a.depths for a in of_class(type(denoiser).__name__) if a.depths is not None), None)


def model_depth(table: AliasTable, depths: Depths) -> int:
    """Blocks in the model's chain (its highest index + 1; 0 without the chain)."""
    rx = re.compile(rf"^{re.escape(depths.chain)}\.(\d+)\.")
    return 1 + max((int(m[1]) for name in table.modules if (m := rx.match(name))), default=-1)


def _indexed(adapter: Adapter, table: AliasTable, rx: re.Pattern[str]) -> list[tuple[AdapterPart, int]]:
    """(part, block index) of the denoiser parts whose names, at block 0, are modules of this model: the
    architecture's own names (another architecture's `blocks.N` keys are not counted)."""
    out = []
    for part in adapter.parts:
        m = rx.match(part.path)
        if part.component != DENOISER or m is None:
            continue
        at_zero = part.path[: m.start("index")] + "0" + part.path[m.end("index") :]
        if isinstance(table.lookup(at_zero, adapter.traits), tuple):
            out.append((part, int(m["index"])))
    return out


def file_depth(adapter: Adapter, indices: list[int], depths: Depths, model: int) -> FileDepth | None:
    """The depth the file was trained on: its metadata's, else its highest block index + 1 snapped up to the
    nearest depth released (or the model's own); None where it names no block."""
    source = adapter.path or adapter.name
    args = kohya_args(adapter.metadata, source)
    declared = kohya_number({}, f"ss_network_args.{METADATA_DEPTH}", source, args.get(METADATA_DEPTH))
    if declared is not None:
        if declared != int(declared) or declared < 1:
            raise AdapterMetadataError(
                source, f"ss_network_args.{METADATA_DEPTH}", f"is {declared!r}, not a block count"
            )
        return FileDepth(int(declared), f"metadata ss_network_args.{METADATA_DEPTH}")
    if not indices:
        return None
    highest = max(indices)
    snapped = min((d for d in (*depths.known, model) if d > highest), default=highest + 1)
    return FileDepth(snapped, f"highest block index {highest}")


def new_index(index: int, inserted: tuple[int, ...]) -> int:
    """The model's index of the file's block `index`: the index-th position not inserted."""
    kept = index
    for at in sorted(inserted):
        if at <= kept:
            kept += 1
    return kept


def map_depth(adapter: Adapter, denoiser: object, table: AliasTable) -> tuple[Adapter, dict[int, str]]:
    """(adapter, {id(part): note}): the adapter with its blocks moved to the model's positions (as it is where
    the depths agree or the architecture declares no variants). DepthMismatchError where they differ and
    the positions are not declared."""
    depths = depths_of(denoiser)
    if depths is None:
        return adapter, {}
    model = model_depth(table, depths)
    if model not in depths.known:  # a sibling of the class (Cosmos-Predict2 14B, 36 blocks): not this chain
        return adapter, {}
    rx = re.compile(depths.path)
    indexed = _indexed(adapter, table, rx)
    found = file_depth(adapter, [i for _, i in indexed], depths, model)
    if found is None or found.depth == model:
        return adapter, {}
    inserted = depths.inserted.get((found.depth, model))
    if inserted is None or max((i for _, i in indexed), default=0) >= found.depth:
        raise DepthMismatchError(adapter.name, found.depth, model, found.how, sorted(depths.inserted))
    moved, notes = {}, {}
    for part, index in indexed:
        m = rx.match(part.path)
        assert m is not None  # _indexed kept only matching parts
        to = new_index(index, inserted)
        path = part.path[: m.start("index")] + str(to) + part.path[m.end("index") :]
        moved[id(part)] = dataclasses.replace(part, path=path)
        notes[id(moved[id(part)])] = (
            f"block {index} -> {to} ({found.depth}-block file on a {model}-block model; {depths.source})"
        )
    out = copy.copy(adapter)
    out.parts = [moved.get(id(p), p) for p in adapter.parts]
    log.info(
        "depth map adapter=%s file_depth=%d model_depth=%d how=%r moved=%d",
        adapter.name,
        found.depth,
        model,
        found.how,
        len(moved),
    )
    return out, notes
