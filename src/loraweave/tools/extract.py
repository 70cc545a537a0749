"""`extract` (LoRA from the difference of two checkpoints) and `resize` (LoRA/LoHa/LoKr/full -> LoRA of rank R).

Both stream layer by layer: one ΔW in memory at a time, truncated by SVD to a fixed rank or to the smallest rank
that keeps a share of its energy (Σσ² of the kept singular values / Σσ²), which is reported per layer."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..arguments import fraction, non_negative, positive_int
from ..errors import ArgumentError, EmptyOutputError
from ..families import FAMILIES
from ..families.base import PartRejected
from ..formats.adapter import load_adapter
from ..formats.alpha import resolve_scale
from ..formats.keys import CLONEOFSIMO_STEM_RE, DENOISER
from ..io.safetensors_file import read_safetensors_header
from ..io.write import check_output, save_file
from ..progress import bar
from .bake import _read
from .checkpoint import open_checkpoint
from .positional import name_positional

log = logging.getLogger("loraweave")
RESIZABLE = ("lora", "loha", "lokr", "full")


@dataclass
class LowRankResult:
    output: Path
    layers: list[dict] = field(default_factory=list)  # {name, rank, energy}
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> tensors or parts
    seconds: float = 0.0

    @property
    def energy_min(self) -> float | None:
        return min((la["energy"] for la in self.layers), default=None)

    @property
    def energy_median(self) -> float | None:
        return statistics.median(la["energy"] for la in self.layers) if self.layers else None

    def to_dict(self) -> dict:
        return {
            "output": str(self.output),
            "layers": self.layers,
            "skipped": self.skipped,
            "energy_min": self.energy_min,
            "energy_median": self.energy_median,
            "seconds": self.seconds,
        }


def truncate(
    delta: torch.Tensor, rank: int | None, energy: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Best rank-r factors of a 2-D ΔW: (up (rows, r), down (r, cols), captured energy share).

    r = `rank`, or the smallest rank keeping `energy` of Σσ² (capped at `rank` when both are given)."""
    u, s, vh = torch.linalg.svd(delta, full_matrices=False)
    power = s.double() ** 2
    total = float(power.sum())
    if total == 0.0:
        return delta.new_zeros(delta.shape[0], 1), delta.new_zeros(1, delta.shape[1]), 1.0
    cum = torch.cumsum(power, 0) / total
    cap = min(rank or len(s), len(s))
    r = (
        cap
        if energy is None
        else min(int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype))) + 1, cap)
    )
    root = s[:r].sqrt()  # split σ evenly so neither factor carries the whole dynamic range (fp16 outputs)
    return u[:, :r] * root, root[:, None] * vh[:r], float(cum[r - 1])


def lora_truncate(
    up: torch.Tensor, down: torch.Tensor, rank: int | None, energy: float | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`truncate(up @ down)` without forming ΔW: QR of both factors, SVD of the small r×r core."""
    qu, ru = torch.linalg.qr(up)
    qd, rd = torch.linalg.qr(down.T)
    core_up, core_down, captured = truncate(ru @ rd.T, rank, energy)
    return qu @ core_up, core_down @ qd.T, captured


def _write_pair(
    out: dict,
    stem: str,
    up: torch.Tensor,
    down: torch.Tensor,
    in_shape: tuple[int, ...],
    dtype: torch.dtype,
    peft: bool,
    alpha: bool = True,
) -> None:
    r = down.shape[0]
    names = (".lora_B.weight", ".lora_A.weight") if peft else (".lora_up.weight", ".lora_down.weight")
    kernel = in_shape[1:]
    out[stem + names[1]] = down.reshape(r, *in_shape).to(dtype).contiguous()
    out[stem + names[0]] = up.reshape(up.shape[0], r, *([1] * len(kernel))).to(dtype).contiguous()
    if alpha:  # alpha = rank: scale 1 in every loader (diffusers-layout files leave it out: PEFT's default)
        out[stem + ".alpha"] = torch.tensor(float(r))


def check_lowrank_args(rank: int | None, energy: float | None) -> None:
    """--rank an int >= 1, --energy in (0, 1]; at least one of them."""
    if rank is None and energy is None:
        raise ArgumentError("give --rank, --energy, or both")
    if rank is not None:
        positive_int(rank, "rank")
    if energy is not None:
        fraction(energy, "energy")


def _refuse_empty(result: LowRankResult, what: str, allow_empty: bool) -> None:
    if not result.layers and not allow_empty:
        skipped = ", ".join(f"{n} x {k}" for k, n in result.skipped.items()) or "nothing to read"
        raise EmptyOutputError(
            f"{what}: no layer to write ({skipped}); the output would be an empty adapter; "
            "nothing written (--allow-empty writes it anyway)",
            result,
        )


def _component_prefix(comp) -> str:
    """Output key prefix: diffusers' component names for diffusers-named weights (its loader reads them), ComfyUI's
    `diffusion_model.` for original (ldm/BFL) names and for models that are neither."""
    if comp.prefix == "model.diffusion_model.":
        return "diffusion_model."
    if comp.name == "denoiser":
        cls = comp.class_name or ""
        if cls:
            return "unet." if cls.startswith("UNet") else "transformer."
        names = {n.split(".", 1)[0] for n in comp.tensors}
        if {"down_blocks", "mid_block", "up_blocks"} <= names:
            return "unet."
        return "transformer." if "transformer_blocks" in names else "diffusion_model."
    return f"{comp.name}."


def extract(
    base: str | os.PathLike,
    tuned: str | os.PathLike,
    output: str | os.PathLike,
    rank: int | None = None,
    energy: float | None = None,
    dtype: str | None = None,
    min_rel_diff: float = 0.0,
    overwrite: bool = False,
    allow_empty: bool = False,
    progress: bool = False,
) -> LowRankResult:
    """LoRA of TUNED - BASE for every ≥2-D floating weight whose shapes agree; 1-D differences are reported.

    Refuses (EmptyOutputError, nothing written) when no layer differs, unless `allow_empty`."""
    check_lowrank_args(rank, energy)
    non_negative(min_rel_diff, "min_diff")
    t0 = time.perf_counter()
    out = check_output(output, [base, tuned], overwrite=overwrite)
    b_ckpt, t_ckpt = open_checkpoint(base), open_checkpoint(tuned)
    tuned_where = {name: shard for c in t_ckpt.components for name, shard in c.tensors.items()}
    headers: dict[Path, tuple] = {}

    def tensor(where: Path, name: str) -> torch.Tensor:
        if where not in headers:
            headers[where] = (*read_safetensors_header(where)[::2], os.open(where, os.O_RDONLY))
        header, data_start, fd = headers[where]
        d, shape, begin, end = header[name]
        return _read(fd, d, shape, data_start + begin, end - begin)

    result = LowRankResult(out)
    skipped: Counter = Counter()
    tensors: dict[str, torch.Tensor] = {}
    steps = bar(
        total=sum(len(c.tensors) for c in b_ckpt.components), desc="extract", unit="tensor", enabled=progress
    )
    try:
        for comp in b_ckpt.components:
            prefix = _component_prefix(comp)
            for name, shard in comp.tensors.items():
                steps.update(1)
                if name not in tuned_where:
                    skipped["missing in tuned"] += 1
                    continue
                wb, wt = tensor(shard, name), tensor(tuned_where[name], name)
                if wb.shape != wt.shape or not wb.is_floating_point():
                    skipped["shape or dtype differs"] += 1
                    continue
                delta = (
                    wt.float() - wb.float()
                )  # exact for fp16/bf16 inputs; fp32 SVD is several times faster
                if not bool(delta.any()):
                    skipped["unchanged"] += 1
                    continue
                if wb.dim() < 2 or not name.endswith(".weight"):
                    skipped["1-D or non-weight tensor differs (not expressible as LoRA)"] += 1
                    continue
                if min_rel_diff and float(delta.norm() / wb.float().norm().clamp_min(1e-30)) < min_rel_diff:
                    skipped["below --min-diff"] += 1
                    continue
                up, down, captured = truncate(delta.flatten(1), rank, energy)
                stem = prefix + name[len(comp.prefix) : -len(".weight")]
                out_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}.get(
                    dtype, wt.dtype
                )
                diffusers = (
                    prefix != "diffusion_model."
                )  # diffusers layout: lora_A/lora_B, no alpha (scale 1)
                _write_pair(
                    tensors,
                    stem,
                    up,
                    down,
                    tuple(wb.shape[1:]),
                    out_dtype,
                    peft=diffusers,
                    alpha=not diffusers,
                )
                result.layers.append({"name": stem, "rank": down.shape[0], "energy": captured})
    finally:
        steps.close()
        for _, _, fd in headers.values():
            os.close(fd)
        b_ckpt.close()
        t_ckpt.close()
    result.skipped = dict(skipped)
    _refuse_empty(result, f"extract {base} -> {tuned}", allow_empty)
    meta = {
        "loraweave.extracted": json.dumps(
            {
                "base": Path(base).name,
                "tuned": Path(tuned).name,
                "rank": rank,
                "energy": energy,
                "layers": len(result.layers),
            }
        )
    }
    save_file(tensors, out, meta, inputs=[base, tuned], overwrite=overwrite)
    result.seconds = time.perf_counter() - t0
    log.info(
        "extract output=%s layers=%d energy_min=%s energy_median=%s seconds=%.3f",
        out,
        len(result.layers),
        result.energy_min,
        result.energy_median,
        result.seconds,
    )
    return result


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
    cap = min(rank or len(order), len(order))
    r = (
        cap
        if energy is None
        else min(int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype))) + 1, cap)
    )
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
    family.add_delta(delta, factors, 0, factors.rows, 1.0)
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
) -> tuple[dict[str, tuple[int, ...]], dict[str, float]]:
    """({part stem: (in, *kernel) of the module it lands on}, {component as the file names it: the metadata network
    alpha its model's trainers record}). Flat-stored conv factors (old LoHa/LoKr) do not say their kernel; the
    model does. Architecture: given, or detected (nothing when unknown)."""
    from ..arch.aliases import metadata_alpha_of
    from ..arch.spec import module_shape
    from ..resolve.planner import network_alpha, resolve
    from ..resolve.target import Components
    from .inspect import adapter_target

    components, _, _ = adapter_target(adapter, arch, model)
    if components is None:
        return {}, {}
    comps = Components(components)
    alphas = {}
    for name in {p.component for p in adapter.parts}:
        target = comps.resolve_name(name)  # the model's class, as apply's alias table reads it
        alpha = network_alpha(adapter, metadata_alpha_of(components[target])) if target else None
        if alpha is not None:
            alphas[name] = alpha
    plan = resolve(comps, [(adapter, 1.0)])
    out = {}
    for pp in plan.planned:
        shape = module_shape(components[pp.component].get_submodule(pp.pieces[0].module))
        if shape is not None and len(shape) >= 2:
            out[pp.part.stem] = tuple(shape[1:])
    return out, alphas


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

    Conv kernels the factors do not carry come from the target (`arch`, `model`, or the detected architecture).
    Positional (cloneofsimo) parts are named by the resolver `apply` uses, on `arch` (or the UNet they fit).
    Refuses (EmptyOutputError, nothing written) when no part can be resized, unless `allow_empty`."""
    check_lowrank_args(rank, energy)
    t0 = time.perf_counter()
    out = check_output(output, [path], overwrite=overwrite)
    adapter = name_positional(load_adapter(path, allow_pickle=allow_pickle), arch)
    targets, metadata_alphas = _targets(adapter, arch, model)
    result = LowRankResult(out)
    skipped: Counter = Counter()
    tensors: dict[str, torch.Tensor] = {}
    for part in bar(adapter.parts, desc="resize", unit="part", enabled=progress):
        if part.family not in RESIZABLE or part.layout == "cloneofsimo":
            skipped[
                f"{part.family} ({part.layout}) cannot be resized without the base weight or a model"
            ] += len(part.keys)
            continue
        family = FAMILIES[part.family]
        try:
            roles = {r: adapter.tensor(k) for r, k in part.roles.items() if r not in ("alpha", "scale")}
            factors = family.load(roles, part.roles)
            alpha = float(adapter.tensor(part.roles["alpha"]).float()) if "alpha" in part.roles else None
            scale_t = float(adapter.tensor(part.roles["scale"]).float()) if "scale" in part.roles else None
            if part.family == "full" or factors.rank is None:
                scale = 1.0
            else:
                scale, _ = resolve_scale(
                    alpha,
                    scale_t,
                    factors.rank,
                    factors.is_conv_kernel,
                    part.path,
                    part.component if part.explicit_component else "",
                    adapter.meta_alpha,
                    metadata_alphas.get(part.component),
                )
        except PartRejected as exc:
            skipped[f"unreadable part: {exc}"] += len(part.keys)
            continue
        if part.family == "lora" and getattr(factors, "up_bias", None) is not None:
            skipped["LoRA with a bias delta (not expressible as a plain LoRA)"] += len(part.keys)
            continue
        structured = _structured(part, factors) if part.family in ("lokr", "loha") else None
        if part.family == "lora":
            in_shape = tuple(factors.down.shape[1:])
            up, down, captured = lora_truncate(
                factors.up.double() * scale, factors.down.flatten(1).double(), rank, energy
            )
        elif structured is not None:
            in_shape = _in_shape(part, factors)
            pick = kron_truncate if part.family == "lokr" else lora_truncate
            up, down, captured = pick(structured[0] * scale, structured[1], rank, energy)
        else:
            delta, in_shape = _dense(part, factors, family)
            up, down, captured = truncate(delta * scale, rank, energy)
        want = targets.get(part.stem)
        if want is not None and math.prod(want) == math.prod(in_shape) and want != in_shape:
            in_shape = want  # same columns, kernel known from the module
        stored = next(iter(roles.values())).dtype if roles else torch.float32
        out_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}.get(dtype, stored)
        positional = (
            CLONEOFSIMO_STEM_RE.match(part.stem) is not None
        )  # named above: written in diffusers layout
        stem = (
            f"{'unet' if part.component == DENOISER else part.component}.{part.path}"
            if positional
            else part.stem
        )
        _write_pair(tensors, stem, up, down, in_shape, out_dtype, peft=part.layout == "peft" or positional)
        result.layers.append({"name": stem, "rank": down.shape[0], "energy": captured})
    result.skipped = dict(skipped)
    _refuse_empty(result, f"resize {path}", allow_empty)
    meta = {
        k: v for k, v in adapter.metadata.items() if k not in ("ss_network_alpha", "lora_adapter_metadata")
    }
    meta["loraweave.resized"] = json.dumps(
        {"source": Path(path).name, "rank": rank, "energy": energy, "layers": len(result.layers)}
    )
    if rank is not None:
        meta["ss_network_dim"] = str(rank)
    save_file(tensors, out, meta, inputs=[path], overwrite=overwrite)
    result.seconds = time.perf_counter() - t0
    log.info(
        "resize output=%s layers=%d energy_min=%s energy_median=%s seconds=%.3f",
        out,
        len(result.layers),
        result.energy_min,
        result.energy_median,
        result.seconds,
    )
    return result
