"""LoRA / LoCon (incl. Tucker `lora_mid`): ΔW = up @ (mid ∘) down, runtime y += γ·up(mid(down(x)))."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..report.miss import Miss
from .base import Family, PartRejected, RuntimeTerm, cast_once, check_factors


@dataclass
class LoraFactors:
    down: torch.Tensor  # (r, in, *k) with Tucker core folded in; stored dtype
    up: torch.Tensor  # (rows, r)
    up_bias: torch.Tensor | None  # (rows,)
    rank: int
    is_conv_kernel: bool  # kernel larger than 1x1: kohya's conv_alpha applies

    @property
    def rows(self) -> int:
        return self.up.shape[0]


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> LoraFactors:
    """Validate shapes and values of one part's tensors (role -> tensor) and fold Tucker into `down`."""
    if "down" not in tensors or "up" not in tensors:
        missing = "down" if "down" not in tensors else "up"
        raise PartRejected("incomplete", f"incomplete LoRA: no {missing} tensor")
    down, up = tensors["down"], tensors["up"]
    check_factors(tensors, key_of)
    if down.dim() < 2 or down.shape[0] == 0:
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: down {tuple(down.shape)} is not a rank>=1 factor"
        )
    rank = down.shape[0]
    if up.dim() < 2 or up.shape[1] != rank or any(d != 1 for d in up.shape[2:]):
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: up {tuple(up.shape)} does not pair with down {tuple(down.shape)}",
        )
    # Factors stay in their stored dtype (plan needs only shapes); merge and runtime cast where they compute.
    up2d = up.flatten(1)
    if "mid" in tensors:
        down = _tucker_down(down, tensors["mid"])
    bias = tensors.get("up_bias")
    if bias is not None and bias.shape != (up.shape[0],):
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: lora_B.bias {tuple(bias.shape)} for {up.shape[0]} rows"
        )
    conv_kernel = down.dim() > 2 and any(d > 1 for d in down.shape[2:])
    return LoraFactors(down, up2d, bias, rank, conv_kernel)


def _tucker_down(down: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
    """A Tucker LoCon's (r, in, *k) down kernel, once its core (r, r, *k) is checked against a 1x1 down."""
    rank = down.shape[0]
    if mid.dim() < 3 or mid.shape[:2] != (rank, rank) or any(d != 1 for d in down.shape[2:]):
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: Tucker core {tuple(mid.shape)} with down {tuple(down.shape)}",
        )
    return tucker_fold(down, mid)


def tucker_fold(down: torch.Tensor, mid: torch.Tensor) -> torch.Tensor:
    """The (r, in, *k) kernel of a Tucker LoCon: K[m, i, ...] = Σ_n mid[m, n, ...]·down[n, i], down being 1x1.

    fp32, formed as ComfyUI core forms it (one mm of down's transpose by mid's transpose flattened), so a
    merge through ComfyUI's patch list is bit-identical to core's; any other order (an einsum) rounds
    differently."""
    rank, inputs = down.shape[0], down.shape[1]
    product = torch.mm(down.flatten(1).float().t(), mid.float().transpose(0, 1).flatten(1))
    return product.reshape(inputs, rank, *mid.shape[2:]).transpose(0, 1).contiguous()


def widen_input(f: LoraFactors, shape: tuple[int, ...]) -> LoraFactors | None:
    """Zero columns for input channels the adapter never saw (Linear only); None when not a pure widening."""
    if f.down.dim() != 2 or len(shape) != 2 or f.down.shape[1] >= shape[1]:
        return None
    return replace(f, down=torch.nn.functional.pad(f.down, (0, shape[1] - f.down.shape[1])))


def take_columns(f: LoraFactors, start: int, width: int, bias: bool) -> LoraFactors | None:
    """(up, down[:, cols]): up @ down[:, cols] is ΔW[:, cols] exactly (Linear only)."""
    if f.down.dim() != 2 or start + width > f.down.shape[1]:
        return None
    return replace(f, down=f.down[:, start : start + width], up_bias=f.up_bias if bias else None)


def gather_rows(f: LoraFactors, index: torch.Tensor) -> LoraFactors:
    """(up[index], down): the rows of up @ down in `index` order, exactly."""
    return replace(f, up=f.up[index], up_bias=None if f.up_bias is None else f.up_bias[index])


def input_width(f: LoraFactors) -> int | None:
    """Input columns the adapter was trained on (Linear only): a control LoRA may need the module grown to
    it."""
    return f.down.shape[1] if f.down.dim() == 2 else None


def check_target(f: LoraFactors, shape: tuple[int, ...]) -> Miss | None:
    """Reason the factors cannot land on a module of logical weight shape `shape`, or None."""
    want = shape[1:]
    have = tuple(f.down.shape[1:])
    if have == want:
        return None
    # Linear stored as 1x1 conv factors (or the reverse) is the same matrix.
    if all(d == 1 for d in have[1:]) and all(d == 1 for d in want[1:]) and have[:1] == want[:1]:
        return None
    return Miss("shape_mismatch", f"shape mismatch: adapter input {have} vs module {want}")


def add_delta(target_rows: torch.Tensor, f: LoraFactors, src: int, length: int, coeff: float) -> None:
    """target_rows (length, in*k), fp32 or the weight's own dtype view: += coeff · up[src:src+length] @
    down."""
    target_rows.addmm_(
        cast_once(f.up, target_rows.dtype)[src : src + length],
        cast_once(f.down, target_rows.dtype).flatten(1),
        alpha=coeff,
    )


def set_delta(target_rows: torch.Tensor, f: LoraFactors, src: int, length: int, coeff: float) -> None:
    """target_rows = coeff · up[src:src+length] @ down (beta=0: the rows are neither read nor zeroed
    first)."""
    up = cast_once(f.up, target_rows.dtype)[src : src + length]
    down = cast_once(f.down, target_rows.dtype).flatten(1)
    torch.addmm(target_rows, up, down, beta=0, alpha=coeff, out=target_rows)


def delta_bound(f: LoraFactors, src: int, length: int) -> float:
    """max |up @ down| over rows [src, src+length) is at most max row norm of up · max column norm of down
    (Cauchy-Schwarz per element); fp64, so the bound itself cannot overflow; inf or nan for non-finite
    factors."""
    up = f.up[src : src + length].double()
    down = f.down.flatten(1).double()
    if not up.numel() or not down.numel():
        return 0.0
    # squared norms summed, one root: 0.08 ms against vector_norm along a dim 0.43 ms (3072 x 16 factors)
    return math.sqrt(float(up.square().sum(1).max()) * float(down.square().sum(0).max()))


def bias_delta(f: LoraFactors, src: int, length: int) -> torch.Tensor | None:
    return None if f.up_bias is None else f.up_bias[src : src + length]


def runtime_term(f: LoraFactors, src: int, dst: int, length: int) -> RuntimeTerm:
    return RuntimeTerm(f.down, f.up[src : src + length], None, bias_delta(f, src, length), dst, length)


SPEC = Family(
    "lora",
    load,
    check_target,
    add_delta,
    bias_delta,
    runtime_term,
    roles=("down", "up", "mid", "up_bias"),
    input_width=input_width,
    widen_input=widen_input,
    take_columns=take_columns,
    gather_rows=gather_rows,
    delta_bound=delta_bound,
    set_delta=set_delta,
    fused_add=add_delta,  # one addmm_: the roofline of a merge (issue 39)
)
