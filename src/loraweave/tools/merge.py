"""`merge`: several adapters at their strengths written as one LoRA file (kohya's merge_lora.py /
svd_merge_lora.py). Every adapter is resolved against the model (as `convert` does), so files of different
layouts meet on the same modules. Per target module the LoRA parts are concatenated along the rank, each
part's strength·alpha/rank folded into its up rows (in fp32) and alpha = rank written: applying the result
equals applying the sources at their strengths, to fp32 rounding. Parts of other families (LoKr, LoHa,
full) join as the exact SVD of their ΔW and need --rank; with --rank every module whose concatenated rank is
larger is truncated by SVD (through QR of the factors, ΔW never formed) and its captured energy reported."""

from __future__ import annotations

import errno
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..arguments import positive_int, strength
from ..errors import ArgumentError, EmptyOutputError, MergeError
from ..formats.adapter import Adapter, load_adapter
from ..io.output import check_output
from ..io.write import save_file
from ..progress import bar
from ..resolve.planner import PlannedPart, resolve
from ..resolve.target import Components, as_components
from .convert import TargetPiece, regroup
from .convert_parts import self_check, svd_pair
from .extract import write_pair
from .layout_names import Pair, target_components, target_stem
from .resize import lora_truncate

log = logging.getLogger("loraweave")
MERGE_LAYOUTS = ("kohya", "comfy", "diffusers")
# Descriptive fields kept when every source says the same.
SHARED_FIELDS = ("ss_base_model_version", "modelspec.architecture", "ss_sd_model_name", "ss_v2")


@dataclass
class MergeResult:
    output: Path
    layout: str
    sources: list[dict] = field(default_factory=list)  # {file, strength, parts}
    targets: int = 0
    layers: list[dict] = field(default_factory=list)  # {name, rank, energy}; energy 1.0: exact
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exact(self) -> bool:
        return all(la["energy"] == 1.0 for la in self.layers)

    def to_dict(self) -> dict:
        energies = [la["energy"] for la in self.layers]
        return {
            **vars(self),
            "output": str(self.output),
            "exact": self.exact,
            "energy_min": min(energies, default=None),
            "energy_median": statistics.median(energies) if energies else None,
        }


def merge(
    inputs: Sequence[tuple[str | os.PathLike, float]],
    output: str | os.PathLike,
    rank: int | None = None,
    to: str = "kohya",
    target=None,
    arch: str | None = None,
    model: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
    allow_pickle: bool = False,
) -> MergeResult:
    """Write the adapters `inputs` ((file, strength) pairs) as one LoRA at `output` in layout `to`.

    `target` (module / mapping) overrides `arch` / `model`; without them each file's architecture is
    detected and all must agree. Bad inputs raise typed errors naming the file and field; nothing is
    written then (the output is written atomically)."""
    t0 = time.perf_counter()
    sources = _check_inputs(inputs, rank, to)
    out = check_output(output, [p for p, _ in sources], overwrite=overwrite)
    adapters = _load(sources, allow_pickle)
    components = _components(adapters, target, arch, model)
    live = [(a, s) for a, (_, s) in zip(adapters, sources, strict=True) if s != 0.0]
    plan = resolve(components, live)
    files = {a.name: p for a, (p, _) in zip(adapters, sources, strict=True)}
    _refuse_unmerged(plan, files, rank)
    result = MergeResult(out, to)
    result.sources = [
        {"file": str(p), "strength": s, "parts": len(a.parts)}
        for a, (p, s) in zip(adapters, sources, strict=True)
    ]
    if len(live) < len(adapters):
        result.notes.append("adapters at strength 0 left out")
    tensors = _write_modules(plan, files, rank, to, dtype, result, progress)
    if not tensors:
        raise EmptyOutputError(f"merge: no adapter changes any module; nothing written to {out}", result)
    metadata = _metadata(adapters, sources, rank, to)
    self_check(tensors, metadata, None, components, out, plan)
    save_file(tensors, out, metadata, inputs=[p for p, _ in sources], overwrite=overwrite)
    result.seconds = time.perf_counter() - t0
    log.info(
        "merge output=%s adapters=%d targets=%d exact=%s seconds=%.3f",
        out,
        len(sources),
        result.targets,
        result.exact,
        result.seconds,
    )
    return result


def _check_inputs(inputs, rank: int | None, to: str) -> list[tuple[str, float]]:
    """Files that exist with finite strengths (the message names the file), a valid rank and layout."""
    if to not in MERGE_LAYOUTS:
        raise ArgumentError(f"--to must be one of {MERGE_LAYOUTS}, got {to!r}")
    if rank is not None:
        positive_int(rank, "rank")
    if not inputs:
        raise ArgumentError("merge needs at least one adapter FILE[:STRENGTH]")
    checked = []
    for path, s in inputs:
        if not Path(path).exists():
            raise FileNotFoundError(errno.ENOENT, "no such adapter file or folder", str(path))
        checked.append((str(path), strength(s, f"{path}: strength")))
    return checked


def _load(sources: list[tuple[str, float]], allow_pickle: bool) -> list[Adapter]:
    adapters: list[Adapter] = []
    for i, (path, _) in enumerate(sources):
        adapter = load_adapter(path, allow_pickle=allow_pickle)
        if any(a.name == adapter.name for a in adapters):  # the same file twice: plan names must differ
            adapter.name = f"{adapter.name}#{i}"
        adapters.append(adapter)
    return adapters


def _components(adapters: list[Adapter], target, arch: str | None, model: str | None) -> Components:
    """The model every adapter is resolved against: given, or detected from each file (all must agree)."""
    if target is not None:
        return as_components(target)
    if arch is None and model is None:
        from .target import adapter_target

        detected = {a.path or a.name: adapter_target(a, None, None)[2] for a in adapters}
        if len(set(detected.values())) > 1:
            named = ", ".join(f"{f}: {d}" for f, d in detected.items())
            raise MergeError(
                f"the adapters were trained on different architectures ({named}); a merged file serves one "
                "model (pass --arch NAME to merge them on one anyway); nothing written"
            )
    return target_components(adapters[0], None, arch, model)


def _refuse_unmerged(plan, files: dict[str, str], rank: int | None) -> None:
    """Keys that land nowhere, families that need the base weight, and non-LoRA parts without --rank."""
    if plan.unmatched:
        u = plan.unmatched[0]
        raise MergeError(
            f"{files.get(u.adapter, u.adapter)}: key {u.key} does not land on the model ({u['reason']}); "
            f"{len(plan.unmatched)} keys in all; a merged file must hold every key of its sources (different "
            "architecture or incompatible shapes?); nothing written"
        )
    for pp in plan.planned:
        where = f"{files.get(pp.adapter.name, pp.adapter.name)}: {pp.part.family} part {pp.part.stem}"
        if pp.family.needs_base:
            raise MergeError(f"{where} needs the model's weight to form its ΔW; nothing written")
        if getattr(pp.factors, "up_bias", None) is not None:
            raise MergeError(f"{where} carries a bias delta, which a LoRA file cannot hold; nothing written")
        if pp.part.family != "lora" and rank is None:
            raise ArgumentError(
                f"{where}: only LoRA parts concatenate exactly; pass --rank R to merge it as a truncated "
                "SVD (captured energy reported)"
            )


def _write_modules(plan, files, rank, to, dtype, result: MergeResult, progress: bool) -> dict:
    """Every target module's concatenated (and, past `rank`, truncated) LoRA in layout `to`."""
    wanted = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    out_dtype = wanted[dtype] if dtype else _widest(plan)

    def pair_of(pp: PlannedPart) -> Pair:
        coeff = pp.strength * pp.scale
        if pp.part.family == "lora":
            f = pp.factors
            return f.down.float(), f.up.float() * coeff, float(f.rank)
        return svd_pair(plan, pp, coeff, None)[0]  # exact: every singular value

    tensors: dict[str, torch.Tensor] = {}
    groups = regroup(plan, to, pair_of)
    components = plan.components
    for (comp, name), (rows, pieces) in bar(
        groups.items(), total=len(groups), desc="merge", unit="module", enabled=progress
    ):
        up, down = _concatenate(rows, pieces, name, files)
        in_shape = tuple(down.shape[1:])
        energy = 1.0
        if rank is not None and down.shape[0] > rank:
            up, down, energy = lora_truncate(up.double(), down.flatten(1).double(), rank, None)
        stem = target_stem(to, comp, name, comp == components.denoiser_name, components)
        write_pair(
            tensors, stem, up, down.flatten(1), in_shape, out_dtype, to == "diffusers", to != "diffusers"
        )
        result.layers.append({"name": stem, "rank": down.shape[0], "energy": energy})
        result.targets += 1
    return tensors


def _concatenate(rows: int, pieces: list[TargetPiece], name: str, files) -> tuple[torch.Tensor, torch.Tensor]:
    """(up (rows, Σr), down (Σr, in, *k)): each part's up rows placed in its own rank columns."""
    parts: dict[int, list[TargetPiece]] = {}
    for p in pieces:
        parts.setdefault(id(p.pp), []).append(p)
    first = pieces[0]
    ups, downs = [], []
    for group in parts.values():
        p = group[0]
        if p.down.shape[1:] != first.down.shape[1:]:
            a, b = (files.get(x.pp.adapter.name, x.pp.adapter.name) for x in (first, p))
            raise MergeError(
                f"{b}: {p.pp.part.stem} has input shape {tuple(p.down.shape[1:])} on {name}, where {a} has "
                f"{tuple(first.down.shape[1:])}: incompatible shapes; nothing written"
            )
        up = p.up.new_zeros(rows, p.down.shape[0])
        for piece in group:
            up[piece.row : piece.row + piece.length] = piece.up
        ups.append(up)
        downs.append(p.down)
    return torch.cat(ups, dim=1), torch.cat(downs)


def _widest(plan) -> torch.dtype:
    """The widest floating dtype among the sources' factors (fp32 when any is fp32)."""
    dtypes = {
        t.dtype for pp in plan.planned for t in vars(pp.factors).values() if isinstance(t, torch.Tensor)
    }
    floats = [d for d in dtypes if d.is_floating_point]
    if not floats or torch.float32 in floats or torch.float64 in floats:
        return torch.float32
    return torch.float16 if torch.float16 in floats else floats[0]


def _metadata(adapters: list[Adapter], sources, rank: int | None, to: str) -> dict[str, str]:
    """The sources and strengths, fields every source agrees on, trigger phrases and tag counts of all."""
    meta: dict[str, str] = {
        "loraweave.merged": json.dumps(
            {
                "sources": [{"file": Path(p).name, "strength": s} for p, s in sources],
                "rank": rank,
                "layout": to,
            }
        ),
        "modelspec.title": " + ".join(f"{Path(p).stem}:{s:g}" for p, s in sources),
        "ss_network_module": "networks.lora",
    }
    for key in SHARED_FIELDS:
        values = {a.metadata.get(key) for a in adapters}
        value = values.pop() if len(values) == 1 else None
        if value is not None:
            meta[key] = value
    phrases = [a.metadata.get("modelspec.trigger_phrase", "").strip() for a in adapters]
    if any(phrases):
        meta["modelspec.trigger_phrase"] = ", ".join(dict.fromkeys(p for p in phrases if p))
    tags: dict[str, object] = {}
    for a, (p, _) in zip(adapters, sources, strict=True):
        try:
            for dataset, counts in json.loads(a.metadata.get("ss_tag_frequency", "{}")).items():
                tags[f"{Path(p).stem}/{dataset}"] = counts
        except (ValueError, AttributeError):
            log.info("merge unreadable ss_tag_frequency in %s", p)
    if tags:
        meta["ss_tag_frequency"] = json.dumps(tags)
    return meta
