"""Full weight difference (`diff`, `diff_b`): ΔW stored as is; runtime is a dense extra product."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..report.miss import Miss
from .base import Family, PartRejected, RuntimeTerm, check_factors


@dataclass
class FullFactors:
    diff: torch.Tensor | None  # (rows, in, *k), stored dtype
    diff_b: torch.Tensor | None  # (rows,)
    rank: int = 0
    is_conv_kernel: bool = False

    @property
    def rows(self) -> int:
        held = self.diff if self.diff is not None else self.diff_b
        assert held is not None  # load keeps a part only with a diff or a bias diff
        return held.shape[0]


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> FullFactors:
    if "diff" not in tensors and "diff_b" not in tensors:
        raise PartRejected("incomplete", "incomplete full diff: neither diff nor diff_b")
    check_factors(tensors, key_of)
    diff = tensors.get("diff")
    diff_b = tensors.get("diff_b")
    if diff is not None and diff_b is not None and diff_b.shape != (diff.shape[0],):
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: diff_b {tuple(diff_b.shape)} for diff {tuple(diff.shape)}"
        )
    return FullFactors(diff, diff_b)


def take_columns(f: FullFactors, start: int, width: int, bias: bool) -> FullFactors | None:
    """diff[:, cols] (Linear only), diff_b with the piece that carries the bias."""
    if f.diff is None or f.diff.dim() != 2 or start + width > f.diff.shape[1]:
        return None
    return FullFactors(f.diff[:, start : start + width], f.diff_b if bias else None)


def gather_rows(f: FullFactors, index: torch.Tensor) -> FullFactors:
    return FullFactors(
        None if f.diff is None else f.diff[index], None if f.diff_b is None else f.diff_b[index]
    )


def input_width(f: FullFactors) -> int | None:
    return f.diff.shape[1] if f.diff is not None and f.diff.dim() == 2 else None


def check_target(f: FullFactors, shape: tuple[int, ...]) -> Miss | None:
    if f.diff is not None and tuple(f.diff.shape[1:]) != shape[1:]:
        return Miss("shape_mismatch", f"shape mismatch: diff {tuple(f.diff.shape)} vs module weight {shape}")
    return None


def add_delta(target_rows: torch.Tensor, f: FullFactors, src: int, length: int, coeff: float) -> None:
    if f.diff is not None:
        target_rows.add_(f.diff[src : src + length].reshape(length, -1).to(target_rows.dtype), alpha=coeff)


def bias_delta(f: FullFactors, src: int, length: int) -> torch.Tensor | None:
    return None if f.diff_b is None else f.diff_b[src : src + length]


def runtime_term(f: FullFactors, src: int, dst: int, length: int) -> RuntimeTerm:
    dense = None if f.diff is None else f.diff[src : src + length]
    return RuntimeTerm(None, None, dense, bias_delta(f, src, length), dst, length)


SPEC = Family(
    "full",
    load,
    check_target,
    add_delta,
    bias_delta,
    runtime_term,
    roles=("diff", "diff_b"),
    input_width=input_width,
    take_columns=take_columns,
    gather_rows=gather_rows,
)
