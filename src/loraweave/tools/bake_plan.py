"""Which tensors of a checkpoint `bake` changes, and how: the adapters resolved on the checkpoint's shadow
tree (names and shapes from the headers, no data read), their pieces moved onto the checkpoint's own tensor
names, and the parts that cannot merge there (no weight, quantized weight, a bias delta without a bias) moved
to unmatched."""

from __future__ import annotations

import copy
from collections import Counter

import torch

from ..families.contribution import bias_of
from ..formats.adapter import load_adapter
from ..io.safetensors_file import read_safetensors_header
from ..report.miss import Miss, Unmatched
from ..resolve.planner import Plan, resolve
from ..resolve.stacking import Contribution
from ..resolve.target import Components
from .checkpoint import Checkpoint, resolution_components
from .positional import name_positional
from .remap import translate


def plan_adapters(
    ckpt: Checkpoint, adapters: list[tuple[str, float]], allow_pickle: bool = False
) -> tuple[Plan, dict[str, dict]]:
    """The adapters resolved on the checkpoint's shadow tree, and each component's original-name spans."""
    loaded = []
    seen: Counter = Counter()
    for path, strength in adapters:
        adapter = name_positional(copy.copy(load_adapter(path, allow_pickle=allow_pickle)))
        seen[adapter.name] += 1
        if seen[adapter.name] > 1:
            adapter.name = f"{adapter.name}#{seen[adapter.name]}"
        loaded.append((adapter, float(strength)))
    trees, spans = resolution_components(ckpt)
    return resolve(Components(trees), loaded), spans


def tensor_plan(
    ckpt: Checkpoint, plan: Plan, spans: dict[str, dict]
) -> dict[str, tuple[str, list[Contribution]]]:
    """{full tensor name: ("weight" | "bias", contributions)}; parts that cannot merge move to
    plan.unmatched."""
    prefix = {c.name: c.prefix for c in ckpt.components}
    tensors = {name: shard for c in ckpt.components for name, shard in c.tensors.items()}
    groups = _module_groups(plan, spans)
    rejected = _rejected(groups, prefix, tensors, _tensor_dtypes(ckpt))
    _drop_rejected(plan, rejected)
    return _work(groups, prefix, rejected)


def _tensor_dtypes(ckpt: Checkpoint) -> dict[str, torch.dtype]:
    """Every tensor's stored dtype, from the shards' headers (no data read)."""
    dtypes: dict[str, torch.dtype] = {}
    for shard in ckpt.files:
        header, _, _ = read_safetensors_header(shard)
        dtypes.update({k: v[0] for k, v in header.items()})
    return dtypes


def _module_groups(plan: Plan, spans: dict[str, dict]) -> dict[tuple[str, str], list[Contribution]]:
    """{(component, checkpoint module name): contributions}, each piece moved onto the checkpoint's own
    names."""
    groups: dict[tuple[str, str], list[Contribution]] = {}
    for pp in plan.planned:
        for piece in pp.pieces:  # on a live module; original-named files: the same rows of their own tensors
            for moved in translate(piece, spans.get(pp.component, {})):
                groups.setdefault((pp.component, moved.module), []).append(Contribution(pp, moved))
    return groups


def _why_not_mergeable(stem: str, tensors: dict, dtypes: dict, needs_bias: bool) -> str | None:
    """Why module `stem` (full tensor-name prefix) cannot take a merge, or None when it can."""
    weight = f"{stem}.weight"
    if weight not in tensors:
        return "module has no weight tensor in the checkpoint"
    if not isinstance(dtypes[weight], torch.dtype) or not dtypes[weight].is_floating_point:
        return f"weight dtype {dtypes[weight]} is not floating point (quantized checkpoint)"
    if needs_bias and f"{stem}.bias" not in tensors:
        return "adapter carries a bias delta but the module has no bias"
    return None


def _rejected(
    groups: dict[tuple[str, str], list[Contribution]], prefix: dict[str, str], tensors: dict, dtypes: dict
) -> dict[int, Miss]:
    """{id(planned part): why} for every part with a piece on a module that cannot take a merge."""
    rejected: dict[int, Miss] = {}
    for (comp, module), contribs in groups.items():
        needs_bias = any(bias_of(pp, pc) is not None for pp, pc in contribs)
        why = _why_not_mergeable(f"{prefix[comp]}{module}", tensors, dtypes, needs_bias)
        for pp, _ in contribs if why else ():
            rejected.setdefault(id(pp), Miss("no_mechanism", f"cannot merge: {why} ({comp}.{module})"))
    return rejected


def _drop_rejected(plan: Plan, rejected: dict[int, Miss]) -> None:
    """A part split over several modules lands everywhere or nowhere: rejected parts' keys become
    unmatched."""
    for pp in plan.planned:
        if id(pp) in rejected:
            plan.unmatched += [Unmatched(pp.adapter.name, k, rejected[id(pp)]) for k in pp.part.keys]
    plan.planned = [pp for pp in plan.planned if id(pp) not in rejected]


def _work(
    groups: dict[tuple[str, str], list[Contribution]], prefix: dict[str, str], rejected: dict[int, Miss]
) -> dict[str, tuple[str, list[Contribution]]]:
    out: dict[str, tuple[str, list[Contribution]]] = {}
    for (comp, module), contribs in groups.items():
        kept = [Contribution(pp, pc) for pp, pc in contribs if id(pp) not in rejected]
        if kept:
            out[f"{prefix[comp]}{module}.weight"] = ("weight", kept)
            if any(bias_of(pp, pc) is not None for pp, pc in kept):
                out[f"{prefix[comp]}{module}.bias"] = ("bias", kept)
    return out


# Module names that say which layout a name is in; ldm names hold transformer_blocks too, so original wins.
ORIGINAL_MARKERS = ("input_blocks", "middle_block", "output_blocks", "double_blocks", "single_blocks")
DIFFUSERS_MARKERS = ("down_blocks", "mid_block", "up_blocks", "transformer_blocks")


def _layout_of(names) -> str | None:
    """ "original", "diffusers" or None, for tensor names or adapter keys (kohya's underscores read as
    dots)."""
    words = ["." + name.replace("_", ".") + "." for name in names]

    def has(markers: tuple[str, ...]) -> bool:
        return any("." + m.replace("_", ".") + "." in w for w in words for m in markers)

    return "original" if has(ORIGINAL_MARKERS) else "diffusers" if has(DIFFUSERS_MARKERS) else None


def layout_hint(ckpt: Checkpoint, plan: Plan, model) -> str:
    """When no key landed because an adapter and the checkpoint name modules in different layouts and nothing
    maps one onto the other (no catalog architecture fits, no config.json beside the file): what to run."""
    if ckpt.kind != "file" or (ckpt.root.parent / "config.json").exists():
        return ""
    mine = _layout_of(name for c in ckpt.components for name in c.tensors)
    for adapter in plan.adapters:
        misses = [u for u in plan.unmatched if u.adapter == adapter.name]
        theirs = _layout_of(u.key for u in misses)
        named_elsewhere = all(u.kind == "no_such_module" for u in misses)  # not a wrong-size model
        if mine and theirs and mine != theirs and named_elsewhere and adapter.path:
            to = "diffusers" if mine == "diffusers" else "comfy"
            return (
                f"; {adapter.path} names modules in the {theirs} layout and {model} in the {mine} one, which "
                "matches no built-in architecture and has no config.json beside it: convert the adapter "
                "first "
                f"(loraweave convert {adapter.path} --to {to} --model FOLDER -o OUT.safetensors, FOLDER "
                f"being a diffusers folder of this model with its config.json), or put that config.json "
                f"beside {model}"
            )
    return ""
