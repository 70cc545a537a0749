"""`extract`: a LoRA from the difference of two checkpoints, and what it shares with `resize`
(tools/resize.py).

Both stream layer by layer: one ΔW in memory at a time, truncated by SVD to a fixed rank or to the smallest
rank that keeps a share of its energy (Σσ² of the kept singular values / Σσ²), which is reported per layer."""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..arguments import fraction, non_negative, positive_int
from ..errors import ArgumentError, EmptyOutputError
from ..io.output import check_output
from ..io.safetensors_file import read_safetensors_header
from ..io.write import save_file
from ..progress import bar
from .bake import _read
from .checkpoint import open_checkpoint

log = logging.getLogger("loraweave")


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


def kept_rank(cum: torch.Tensor, rank: int | None, energy: float | None) -> int:
    """Rank to keep from the cumulative energy shares `cum` (descending σ): `rank`, or the smallest keeping
    `energy`, capped at `rank` when both are given."""
    cap = min(rank or len(cum), len(cum))
    if energy is None:
        return cap
    return min(int(torch.searchsorted(cum, torch.tensor(energy, dtype=cum.dtype))) + 1, cap)


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
    r = kept_rank(cum, rank, energy)
    root = s[:r].sqrt()  # split σ evenly so neither factor carries the whole dynamic range (fp16 outputs)
    return u[:, :r] * root, root[:, None] * vh[:r], float(cum[r - 1])


def write_pair(
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


def refuse_empty(result: LowRankResult, what: str, allow_empty: bool) -> None:
    if not result.layers and not allow_empty:
        skipped = ", ".join(f"{n} x {k}" for k, n in result.skipped.items()) or "nothing to read"
        raise EmptyOutputError(
            f"{what}: no layer to write ({skipped}); the output would be an empty adapter; "
            "nothing written (--allow-empty writes it anyway)",
            result,
        )


def finish(result: LowRankResult, verb: str, t0: float) -> LowRankResult:
    """Time the run (from perf_counter `t0`) and log its key=value summary."""
    result.seconds = time.perf_counter() - t0
    log.info(
        "%s output=%s layers=%d energy_min=%s energy_median=%s seconds=%.3f",
        verb,
        result.output,
        len(result.layers),
        result.energy_min,
        result.energy_median,
        result.seconds,
    )
    return result


def narrower_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype | None:
    """The one of two float dtypes whose values the other holds exactly (fp16 or bf16 in fp32/fp64, fp32 in
    fp64); None when equal or neither holds the other (fp16 and bf16)."""
    wide = (torch.float64, torch.float32)
    for x, y in ((a, b), (b, a)):
        if x in wide and y.is_floating_point and torch.finfo(y).bits < torch.finfo(x).bits:
            return y
    return None


def _component_prefix(comp) -> str:
    """Output key prefix: diffusers' component names for diffusers-named weights (its loader reads them),
    ComfyUI's `diffusion_model.` for original (ldm/BFL) names and for models that are neither."""
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
    skip_rounding: bool = False,
) -> LowRankResult:
    """LoRA of TUNED - BASE for every ≥2-D floating weight whose shapes agree; 1-D differences are reported.

    A layer whose difference is only the rounding of one side's wider dtype to the other's (fp32 BASE, fp16
    TUNED) holds no fine-tuning: a WARNING counts them, `skip_rounding` leaves them out.
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
    rounding: Counter = Counter()  # layers whose ΔW is only a dtype's rounding, by the narrower dtype
    tensors: dict[str, torch.Tensor] = {}
    steps = bar(
        total=sum(len(c.tensors) for c in b_ckpt.components), desc="extract", unit="tensor", enabled=progress
    )
    try:
        if not any(name in tuned_where for comp in b_ckpt.components for name in comp.tensors):
            raise ArgumentError(  # bad input (exit 2), not an empty result: nothing was compared
                f"{tuned}: no tensor name in common with {base}; TUNED must be a fine-tuned copy of BASE "
                "(an adapter file is merged with bake, not extracted)"
            )
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
                narrow = narrower_dtype(wb.dtype, wt.dtype)
                if narrow is not None and torch.equal(wb.to(narrow), wt.to(narrow)):
                    rounding[str(narrow).removeprefix("torch.")] += 1
                    if skip_rounding:
                        skipped[f"differs only by rounding to {str(narrow).removeprefix('torch.')}"] += 1
                        continue
                if min_rel_diff and float(delta.norm() / wb.float().norm().clamp_min(1e-30)) < min_rel_diff:
                    skipped["below --min-diff"] += 1
                    continue
                up, down, captured = truncate(delta.flatten(1), rank, energy)
                stem = prefix + name[len(comp.prefix) : -len(".weight")]
                named = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
                out_dtype = wt.dtype if dtype is None else named.get(dtype, wt.dtype)
                diffusers = (
                    prefix != "diffusion_model."
                )  # diffusers layout: lora_A/lora_B, no alpha (scale 1)
                write_pair(
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
    if rounding and not skip_rounding:
        log.warning(
            "extract rounding_only=%d layers=%d: %d written layers differ from BASE only by rounding to %s "
            "(no fine-tuning in them); skip_rounding=True (--skip-rounding) leaves them out",
            sum(rounding.values()),
            len(result.layers),
            sum(rounding.values()),
            "/".join(rounding),
        )
    refuse_empty(result, f"extract {base} -> {tuned}", allow_empty)
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
    return finish(result, "extract", t0)
