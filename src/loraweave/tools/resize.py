"""`resize`: every LoRA/LoHa/LoKr/full part of an adapter rewritten as a LoRA of rank R (or of the smallest
rank keeping a share of Σσ²), its scale folded in and alpha = rank. LoRA parts are truncated through QR of
their factors, LoKr through the two small SVDs of its Kronecker halves, non-Tucker LoHa as the exact LoRA of
rank r1·r2 it is; the others one dense ΔW at a time."""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from pathlib import Path

import torch

from ..families import FAMILIES
from ..families.base import PartRejected
from ..formats.adapter import load_adapter
from ..formats.keys import CLONEOFSIMO_STEM_RE, DENOISER
from ..io.output import check_output
from ..io.write import data_sha256, save_file
from ..progress import bar
from ..resolve.planner import part_scale
from .extract import LowRankResult, check_lowrank_args, finish, kept_rank, refuse_empty, truncate, write_pair
from .positional import name_positional

RESIZABLE = ("lora", "loha", "lokr", "full")


def lora_truncate(
    up: torch.Tensor, down: torch.Tensor, rank: int | None, energy: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`truncate(up @ down)` without forming ΔW: QR of both factors, SVD of the small r×r core."""
    qu, ru = torch.linalg.qr(up)
    qd, rd = torch.linalg.qr(down.T)
    core_up, core_down, captured = truncate(ru @ rd.T, rank, energy)
    return qu @ core_up, core_down @ qd.T, captured


def kron_truncate(
    w1: torch.Tensor, w2: torch.Tensor, rank: int | None, energy: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Best rank-r factors of kron(w1, w2) from the two small SVDs: its singular triplets are the pairwise
    (Kronecker) products of theirs, so the (a·b, c·n) ΔW is never formed."""
    u1, s1, v1 = torch.linalg.svd(w1, full_matrices=False)
    u2, s2, v2 = torch.linalg.svd(w2, full_matrices=False)
    products = torch.outer(s1, s2).flatten()
    order = torch.argsort(products, descending=True)
    power = products[order].double() ** 2
    total = float(power.sum())
    if total == 0.0:
        return w1.new_zeros(w1.shape[0] * w2.shape[0], 1), w1.new_zeros(1, w1.shape[1] * w2.shape[1]), 1.0
    cum = torch.cumsum(power, 0) / total
    r = kept_rank(cum, rank, energy)
    i, j = order[:r] // len(s2), order[:r] % len(s2)
    root = products[order[:r]].sqrt()
    up = (u1[:, i][:, None, :] * u2[:, j][None, :, :]).reshape(-1, r) * root
    down = (v1[i][:, :, None] * v2[j][:, None, :]).reshape(r, -1) * root[:, None]
    return up, down, float(cum[r - 1])


def _structured(part, factors) -> tuple[torch.Tensor, torch.Tensor] | None:
    """LoKr and (non-Tucker) LoHa have exact low-rank structure; None: fall back to the dense ΔW."""
    if part.family == "lokr":
        from ..families import lokr  # its own w1/w2 assembly (factored, full or Tucker halves)

        return lokr._w1(factors, torch.float64), lokr._w2(factors, torch.float64)
    if part.family == "loha" and factors.t1 is None and factors.t2 is None:
        a1, a2 = factors.a1.double(), factors.a2.double()
        b1, b2 = factors.b1.double(), factors.b2.double()
        # (a1 b1) ⊙ (a2 b2) = Σ_pq (a1_p ⊙ a2_q)(b1_p ⊙ b2_q)ᵀ: an exact LoRA of rank r1·r2.
        up = (a1[:, :, None] * a2[:, None, :]).reshape(a1.shape[0], -1)
        down = (b1[:, None, :] * b2[None, :, :]).reshape(-1, b1.shape[1])
        return up, down
    return None


def _dense(part, factors, family) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(ΔW as (rows, in·k) fp32, (in, *k)) of one part at scale 1."""
    in_shape = _in_shape(part, factors)
    delta = torch.zeros(
        factors.rows, math.prod(in_shape), dtype=torch.float32
    )  # fp32 SVD: several times faster
    family.add(delta, factors, 0, factors.rows, 1.0)
    return delta, in_shape


def _in_shape(part, factors) -> tuple[int, ...]:
    """(in, *kernel) of the part's target; a kernel the factors do not carry is unknown: written as Linear."""
    if part.family == "lora":
        in_shape = tuple(factors.down.shape[1:])
    elif part.family == "full":
        in_shape = tuple(factors.diff.shape[1:])
    elif part.family == "lokr":
        kernel = factors.target_kernel or factors.kernel or ()
        in_shape = (factors.c * factors.n // max(1, math.prod(kernel)), *kernel)
    else:
        in_shape = tuple(factors.in_shape) if factors.in_shape else (factors.cols,)
    return in_shape


def _targets(
    adapter, arch: str | None, model: str | None
) -> tuple[dict[str, tuple[int, ...]], dict[str, str | None]]:
    """({part stem: (in, *kernel) of the module it lands on}, {component as the file names it: the
    `__metadata__` field its model's trainers record one network alpha in}). Flat-stored conv factors (old
    LoHa/LoKr) do not say their kernel; the model does. Architecture: given, or detected (nothing when
    unknown)."""
    from ..arch.aliases import metadata_alpha_of
    from ..arch.spec import module_shape
    from ..resolve.planner import resolve
    from ..resolve.target import Components
    from .target import adapter_target

    components, _, _ = adapter_target(adapter, arch, model)
    if components is None:
        return {}, {}
    comps = Components(components)
    fields = {}
    for name in {p.component for p in adapter.parts}:
        target = comps.resolve_name(name)  # the model's class, as apply's alias table reads it
        fields[name] = metadata_alpha_of(components[target]) if target else None
    plan = resolve(comps, [(adapter, 1.0)])
    out = {}
    for pp in plan.planned:
        shape = module_shape(components[pp.component].get_submodule(pp.pieces[0].module))
        if shape is not None and len(shape) >= 2:
            out[pp.part.stem] = tuple(shape[1:])
    return out, fields


def resize(
    path: str | os.PathLike,
    output: str | os.PathLike,
    rank: int | None = None,
    energy: float | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
    arch: str | None = None,
    model: str | None = None,
    allow_empty: bool = False,
    progress: bool = False,
    allow_pickle: bool = False,
) -> LowRankResult:
    """Rewrite every LoRA/LoHa/LoKr/full part as a LoRA of rank ≤ R (its scale folded in, alpha = rank).

    Conv kernels the factors do not carry come from the target (`arch`, `model`, or the detected
    architecture). Positional (cloneofsimo) parts are named by the resolver `apply` uses, on `arch` (or the
    UNet they fit). Refuses (EmptyOutputError, nothing written) when no part can be resized, unless
    `allow_empty`."""
    check_lowrank_args(rank, energy)
    t0 = time.perf_counter()
    out = check_output(output, [path], overwrite=overwrite)
    adapter = name_positional(load_adapter(path, allow_pickle=allow_pickle), arch)
    targets, metadata_fields = _targets(adapter, arch, model)
    result = LowRankResult(out)
    skipped: Counter = Counter()
    tensors: dict[str, torch.Tensor] = {}
    for part in bar(adapter.parts, desc="resize", unit="part", enabled=progress):
        why = _resize_part(adapter, part, metadata_fields, targets, (rank, energy, dtype), tensors, result)
        if why is not None:
            skipped[why] += len(part.keys)
    result.skipped = dict(skipped)
    refuse_empty(result, f"resize {path}", allow_empty)
    metadata = _metadata(adapter, path, rank, energy, result, tensors)
    save_file(tensors, out, metadata, inputs=[path], overwrite=overwrite)
    return finish(result, "resize", t0)


def _resize_part(
    adapter,
    part,
    metadata_fields: dict[str, str | None],
    targets: dict[str, tuple[int, ...]],
    wanted: tuple[int | None, float | None, str | None],
    tensors: dict[str, torch.Tensor],
    result: LowRankResult,
) -> str | None:
    """Write one part as a LoRA into `tensors` (and its layer into `result`); or why it is skipped."""
    rank, energy, dtype = wanted
    if part.family not in RESIZABLE or part.layout == "cloneofsimo":
        return f"{part.family} ({part.layout}) cannot be resized without the base weight or a model"
    try:
        roles, factors, scale = _read_part(adapter, part, metadata_fields.get(part.component))
    except PartRejected as exc:
        return f"unreadable part: {exc}"
    if part.family == "lora" and getattr(factors, "up_bias", None) is not None:
        return "LoRA with a bias delta (not expressible as a plain LoRA)"
    up, down, in_shape, captured = low_rank(part, factors, scale, rank, energy)
    want = targets.get(part.stem)
    if want is not None and math.prod(want) == math.prod(in_shape) and want != in_shape:
        in_shape = want  # same columns, kernel known from the module
    stored = next(iter(roles.values())).dtype if roles else torch.float32
    named = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    out_dtype = stored if dtype is None else named.get(dtype, stored)
    positional = CLONEOFSIMO_STEM_RE.match(part.stem) is not None  # named above: written in diffusers layout
    stem = (
        f"{'unet' if part.component == DENOISER else part.component}.{part.path}" if positional else part.stem
    )
    write_pair(tensors, stem, up, down, in_shape, out_dtype, peft=part.layout == "peft" or positional)
    result.layers.append({"name": stem, "rank": down.shape[0], "energy": captured})
    return None


def _read_part(adapter, part, metadata_field: str | None) -> tuple[dict[str, torch.Tensor], object, float]:
    """(the part's factor tensors by role, its family's factors, its scale as apply settles it:
    part_scale)."""
    roles = {r: adapter.tensor(k) for r, k in part.roles.items() if r not in ("alpha", "scale")}
    family = FAMILIES[part.family]
    factors = family.load_part(roles, part.roles, None)
    scale, _ = part_scale(adapter, part, family, factors, part.component, metadata_field)
    return roles, factors, scale


def low_rank(
    part, factors, scale: float, rank: int | None, energy: float | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], float]:
    """(up, down, (in, *kernel), captured energy) of one part's scaled ΔW, without forming ΔW where the
    family's structure allows (LoRA, LoKr, non-Tucker LoHa)."""
    if part.family == "lora":
        up, down, captured = lora_truncate(
            factors.up.double() * scale, factors.down.flatten(1).double(), rank, energy
        )
        return up, down, tuple(factors.down.shape[1:]), captured
    structured = _structured(part, factors) if part.family in ("lokr", "loha") else None
    if structured is not None:
        pick = kron_truncate if part.family == "lokr" else lora_truncate
        up, down, captured = pick(structured[0] * scale, structured[1], rank, energy)
        return up, down, _in_shape(part, factors), captured
    delta, in_shape = _dense(part, factors, FAMILIES[part.family])
    up, down, captured = truncate(delta * scale, rank, energy)
    return up, down, in_shape, captured


# What names the source file or its network, not the resized one: dropped (hashes are recomputed).
SOURCE_IDENTITY = ("sshs_model_hash", "sshs_legacy_hash", "modelspec.hash_sha256")
SOURCE_NETWORK = ("ss_network_alpha", "ss_network_args", "ss_network_dim", "lora_adapter_metadata")


def _metadata(
    adapter, path, rank: int | None, energy: float | None, result: LowRankResult, tensors: dict
) -> dict[str, str]:
    """The source's metadata less what no longer describes the file, and a `loraweave.resized` record.

    Every part is a plain LoRA with alpha = its rank now: the network module becomes kohya's `networks.lora`,
    the source's alpha, dim and network args (LyCORIS `algo`, conv dims, factors) go; `ss_network_dim` is
    the rank when every layer has it. A source that carried kohya's `sshs_model_hash` gets the output's own
    (A1111's AddNet hash: sha256 of the bytes after the header); its legacy hash and modelspec hash go."""
    source = adapter.metadata
    meta = {k: v for k, v in source.items() if k not in SOURCE_IDENTITY + SOURCE_NETWORK}
    if "ss_network_module" in source:
        meta["ss_network_module"] = "networks.lora"
    ranks = {layer["rank"] for layer in result.layers}
    if len(ranks) == 1:
        meta["ss_network_dim"] = str(ranks.pop())
    if "sshs_model_hash" in source or "sshs_legacy_hash" in source:
        meta["sshs_model_hash"] = data_sha256(tensors)
    meta["loraweave.resized"] = json.dumps(
        {"source": Path(path).name, "rank": rank, "energy": energy, "layers": len(result.layers)}
    )
    return meta
