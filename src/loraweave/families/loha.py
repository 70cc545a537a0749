"""LoHa (Hadamard product, incl. Tucker `hada_t1/t2`): ΔW = (w1a @ w1b) ⊙ (w2a @ w2b); runtime: cached dense
ΔW.

Tucker (conv with kernel > 1): the a-factors are stored transposed, (r, out), and each half is rebuilt as
einsum('i j ..., j q, i p -> p q ...', t, w_b, w_a) before the Hadamard product. γ = alpha / w1_b.shape[0]."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factors

_FACTORS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


@dataclass
class LohaFactors:
    a1: torch.Tensor  # (rows, r1); Tucker a-factors are stored (r, rows) and kept here as a transposed view
    b1: torch.Tensor  # (r1, in*k) flattened; Tucker: (r1, in)
    a2: torch.Tensor  # (rows, r2)
    b2: torch.Tensor  # (r2, in*k); Tucker: (r2, in)
    t1: torch.Tensor | None  # Tucker cores (r1, r1, *k); stored dtype throughout
    t2: torch.Tensor | None
    rank: int  # w1_b.shape[0], the r of alpha/r (LyCORIS, ComfyUI)
    in_shape: (
        tuple[int, ...] | None
    )  # (in, *k); None until check_target sees the module when b is stored flat

    @property
    def rows(self) -> int:
        return self.a1.shape[0]

    @property
    def cols(self) -> int:
        return self.b1.shape[1] * (math.prod(self.t1.shape[2:]) if self.t1 is not None else 1)

    @property
    def is_conv_kernel(self) -> bool:
        return self.in_shape is not None and any(d > 1 for d in self.in_shape[1:])


def _a_factor(t: torch.Tensor, tucker: bool) -> torch.Tensor:
    if tucker:
        return t.t() if t.dim() == 2 else t
    return t.flatten(1) if t.dim() >= 2 and all(d == 1 for d in t.shape[2:]) else t


def _require_complete(tensors: dict[str, torch.Tensor]) -> None:
    """All four factors, and either both Tucker cores or neither."""
    missing = [r for r in _FACTORS if r not in tensors]
    if missing:
        raise PartRejected("incomplete", f"incomplete LoHa: no {', '.join(missing)} tensor")
    if ("hada_t1" in tensors) != ("hada_t2" in tensors):
        raise PartRejected(
            "incomplete",
            f"incomplete LoHa: {'hada_t1' if 'hada_t1' in tensors else 'hada_t2'} without its partner core",
        )


def _pairs(f: LohaFactors) -> bool:
    """Whether the flattened factors multiply: each a with its b, both halves to one (rows, cols)."""
    a1, b1, a2, b2, t1, t2 = f.a1, f.b1, f.a2, f.b2, f.t1, f.t2
    if a1.shape[1] != b1.shape[0] or a2.shape[1] != b2.shape[0] or a1.shape[0] != a2.shape[0]:
        return False
    if b1.shape[1] != b2.shape[1]:
        return False
    if t1 is None:
        return True
    assert t2 is not None  # load keeps the Tucker cores in pairs
    # Tucker: each core (r, r_b, *k) sits between its a and b, and b is 2-D (r_b, in)
    k = tuple(t1.shape[2:])
    return (
        f.in_shape is None
        and t1.dim() >= 3
        and t1.shape[:2] == (a1.shape[1], b1.shape[0])
        and t2.shape == (a2.shape[1], b2.shape[0], *k)
    )


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> LohaFactors:
    """Validate shapes and values of one part's tensors (role -> tensor); factors keep their stored dtype."""
    _require_complete(tensors)
    check_factors(tensors, key_of)
    t1, t2 = tensors.get("hada_t1"), tensors.get("hada_t2")
    a1, a2 = (_a_factor(tensors[r], t1 is not None) for r in ("hada_w1_a", "hada_w2_a"))
    b1, b2 = tensors["hada_w1_b"], tensors["hada_w2_b"]
    shapes = ", ".join(
        f"{r} {tuple(tensors[r].shape)}" for r in (*_FACTORS, "hada_t1", "hada_t2") if r in tensors
    )
    if any(t.dim() != 2 or 0 in t.shape for t in (a1, a2)) or b1.dim() < 2 or b2.dim() < 2:
        raise PartRejected("shape_mismatch", f"shape mismatch: LoHa factors {shapes}")
    in_shape = tuple(b1.shape[1:]) if b1.dim() > 2 else None
    f = LohaFactors(a1, b1.flatten(1), a2, b2.flatten(1), t1, t2, b1.shape[0], in_shape)
    if not _pairs(f):
        raise PartRejected("shape_mismatch", f"shape mismatch: LoHa factors do not pair: {shapes}")
    # Tucker: the input is (in, *k) with the cores' kernel
    return f if t1 is None else dataclasses.replace(f, in_shape=(f.b1.shape[1], *t1.shape[2:]))


def check_target(f: LohaFactors, shape: tuple[int, ...] | None) -> Miss | None:
    """Reason ΔW cannot land on a module of logical weight shape `shape` (out, in, *k), or None.

    Flat (non-Tucker) factors carry in·k but not the kernel: the first module seen fixes it, which also sets
    is_conv_kernel (read after check_target by the planner) and the conv kernel of the runtime path."""
    if shape is None or len(shape) < 2:
        return Miss(
            "shape_mismatch",
            f"shape mismatch: LoHa needs a weight of shape (out, in, *k), module has {shape}",
        )
    want = tuple(shape[1:])
    if f.in_shape == want or (f.in_shape is None and math.prod(want) == f.cols):
        return None
    have = f.in_shape if f.in_shape is not None else (f.cols,)
    return Miss("shape_mismatch", f"shape mismatch: LoHa delta input {have} vs module {want}")


def settle(f: LohaFactors, shape: tuple[int, ...] | None) -> LohaFactors:
    """Flat factors take the kernel of the first module they fit (sets is_conv_kernel and the runtime
    kernel)."""
    if f.in_shape is None and shape is not None and len(shape) >= 2 and math.prod(shape[1:]) == f.cols:
        return dataclasses.replace(f, in_shape=tuple(shape[1:]))
    return f


def _rows(
    f: LohaFactors, src: int, length: int, dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """Rows [src, src+length) of ΔW, (length, in*k), computed in `dtype` (on `device`, default the
    factors')."""
    halves = []
    for a, b, t in ((f.a1, f.b1, f.t1), (f.a2, f.b2, f.t2)):
        a, b = a[src : src + length].to(device, dtype), b.to(device, dtype)
        if t is None:
            halves.append(a @ b)
        else:
            core = torch.einsum("ij...,jq->iq...", t.to(device, dtype), b)  # (r, in, *k)
            halves.append(a @ core.flatten(1))
    return halves[0].mul_(halves[1])


def add_delta(target_rows: torch.Tensor, f: LohaFactors, src: int, length: int, coeff: float) -> None:
    """target_rows (length, in*k), fp32/fp64: += coeff · ΔW[src:src+length] (only those rows are built)."""
    target_rows.add_(_rows(f, src, length, target_rows.dtype, target_rows.device), alpha=coeff)


def bias_delta(f: LohaFactors, src: int, length: int) -> None:
    return None


def runtime_term(f: LohaFactors, src: int, dst: int, length: int) -> RuntimeTerm:
    """Dense form: ΔW rows built once, here, in fp32 (fp64 for fp64 factors) on the factors' device, and held
    (RuntimeTerm.caches: a host counts and moves them); each forward reads its (device, dtype) cast. Strength
    changes reuse them (the runtime path scales fn's output)."""
    acc = torch.promote_types(torch.promote_types(f.a1.dtype, f.a2.dtype), torch.float32)
    cache = CastCache(_rows(f, src, length, acc))

    def fn(x: torch.Tensor, conv: ConvSpec | None) -> torch.Tensor:
        (delta,) = cache.get(x)
        if conv is None:
            return F.linear(x, delta)
        if f.in_shape is None:
            raise RuntimeError("LoHa conv kernel unknown: check_target was never called for this part")
        return conv.fn(x, delta.view(length, *f.in_shape), None, **conv.kwargs)

    cost = f"dense ΔW ({length}×{f.cols}) cached"
    return RuntimeTerm.structured(dst, length, fn=fn, cost=cost, caches=(cache,))


SPEC = Family(
    "loha",
    load,
    check_target,
    add_delta,
    bias_delta,
    runtime_term,
    settle=settle,
    roles=("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
)
