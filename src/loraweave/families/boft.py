"""BOFT (butterfly OFT): m stages of blockwise rotations between butterfly permutations of the rows.

LyCORIS (`oft_blocks` 4-D (m, n, b, b), reached through oft.load; `alpha` = constraint c = α·rows over the
whole 4-D Q; optional `rescale`): stage i (k = 2^i·b/2) views the rows as (−1, 2, k), swaps to (−1, k, 2),
replaces each run of b rows by R_i[blk]·rows (R, not Rᵀ) and swaps back; W' = rescale ⊙ W_m. Strength
interpolates every stage, R_i ← s·R_i + (1−s)·I (LyCORIS's multiplier, applied once); rescale as in oft.py. No
`alpha` = 0 = unconstrained (ComfyUI raises on such files and leaves the weight unpatched: not repeated).
PEFT (`boft_R` (N, D, H, H) + `boft_s`, one per output row): rotates the INPUT columns, W' = boft_s ⊙ (W·Mᵀ),
M = B_{N−1}···B_0, B_i = P_i·blockdiag(R_i)·P_iᵀ with PEFT's block-butterfly permutations P_i (rebuilt from
the shape) and PEFT's Cayley R = (I − S)(I + S)⁻¹, S = (B − Bᵀ)/2. PEFT has no strength; ours interpolates
each stage."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factors, refuse_roles
from .oft_common import acc_dtype, cayley, rescaled, row_scale, scalar_alpha


@dataclass
class BoftFactors:
    blocks: torch.Tensor  # (stages, n, b, b), stored dtype
    constraint: float  # c = α·rows (LyCORIS); 0 = unconstrained
    rescale: torch.Tensor | None  # (rows,): LyCORIS `rescale` or PEFT `boft_s`
    peft: bool  # rotates the input columns (PEFT) instead of the output rows (LyCORIS)
    _rot: dict[tuple[torch.device, torch.dtype], torch.Tensor] = field(
        default_factory=dict
    )  # (device, dtype) -> R (stages, n, b, b)
    # PEFT conv runtime: the last strength's ΔW rows, keyed by (strength, device, dtype, weight version)
    _dense: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        if self.peft:
            assert self.rescale is not None  # load requires PEFT's boft_s
            return self.rescale.numel()
        return self.blocks.shape[1] * self.blocks.shape[2]

    @property
    def span(self) -> int:  # LyCORIS: the last stage mixes rows within aligned runs of this many
        span: int = 2 ** (self.blocks.shape[0] - 1) * self.blocks.shape[2]
        return span


_LYCORIS_ROLES = frozenset({"oft_blocks", "rescale", "alpha"})
_PEFT_ROLES = frozenset({"boft_R", "boft_s"})


def _is_butterfly(blocks: torch.Tensor, peft: bool) -> bool:
    """(m, n, b, b) with stage views that tile: LyCORIS needs b even and n a multiple of 2^(m-1); PEFT checks
    the same when N > 1."""
    if blocks.dim() != 4 or blocks.shape[3] != blocks.shape[2] or 0 in blocks.shape:
        return False
    m, n, b = blocks.shape[:3]
    return not ((m > 1 or not peft) and (b % 2 or n % 2 ** (m - 1)))


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> BoftFactors:
    peft = "boft_R" in tensors
    refuse_roles("BOFT", set(tensors) - (_PEFT_ROLES if peft else _LYCORIS_ROLES), key_of)
    if not peft and "oft_blocks" not in tensors:
        raise PartRejected(
            "incomplete",
            "incomplete BOFT: no oft_blocks or boft_R" + (" (boft_s alone)" if "boft_s" in tensors else ""),
        )
    if peft and "boft_s" not in tensors:
        raise PartRejected("incomplete", "incomplete BOFT: PEFT boft_R without boft_s")
    check_factors(tensors, key_of, skip=("alpha",))
    role = "boft_R" if peft else "oft_blocks"
    blocks = tensors[role]
    if not _is_butterfly(blocks, peft):
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: {key_of[role]} {tuple(blocks.shape)} is not a butterfly (m, n, b, b)",
        )
    if peft:
        scale = tensors["boft_s"]
        return BoftFactors(blocks, 0.0, row_scale(scale, scale.numel(), key_of["boft_s"]), True)
    alpha = scalar_alpha(tensors, key_of)
    n, b = blocks.shape[1], blocks.shape[2]
    return BoftFactors(
        blocks, alpha * n * b, row_scale(tensors.get("rescale"), n * b, key_of.get("rescale")), False
    )


def check_target(f: BoftFactors, shape: tuple[int, ...]) -> Miss | None:
    if f.peft:
        cols = shape[1] * math.prod(shape[2:])
        n = f.blocks.shape[1] * f.blocks.shape[2]
        if cols != n:
            return Miss(
                "shape_mismatch",
                f"shape mismatch: PEFT BOFT rotates {n} input columns, module {shape} has {cols}",
            )
        return None
    if shape[0] % f.span:
        return Miss(
            "shape_mismatch",
            f"shape mismatch: BOFT butterfly mixes runs of {f.span} rows, module has {shape[0]}",
        )
    return None


def _rotations(f: BoftFactors, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    if (device, dtype) not in f._rot:
        acc = torch.promote_types(acc_dtype(f.blocks), dtype)
        if f.peft:
            b = f.blocks.to(acc)
            s = (b - b.transpose(-1, -2)) / 2
            eye = torch.eye(b.shape[-1], dtype=acc)
            r = (eye - s) @ torch.linalg.inv(eye + s)
        else:
            r = cayley(f.blocks, f.constraint, acc)
        f._rot = {(device, dtype): r.to(device, dtype)}
    return f._rot[(device, dtype)]


def _stage(r: torch.Tensor, s: float) -> torch.Tensor:
    return r * s + (1 - s) * torch.eye(r.shape[-1], dtype=r.dtype, device=r.device)


def _butterfly(
    f: BoftFactors, y: torch.Tensor, src: int, s: float, rot: torch.Tensor | None = None
) -> torch.Tensor:
    """LyCORIS stages on channels-last y holding rows [src, src + y.shape[-1]) (aligned to the span); `rot`:
    the rotations of those rows already on y's device and dtype (default: f's, built on first use)."""
    length, (m, _, b) = y.shape[-1], f.blocks.shape[:3]
    if src % f.span or length % f.span:
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: rows [{src}, {src + length}) cut a BOFT butterfly of {f.span} rows",
        )
    if rot is None:
        rot = _rotations(f, y.device, y.dtype)[:, src // b : (src + length) // b]
    for i in range(m):
        k = 2**i * (b // 2)
        # torch leaves Tensor.unflatten unannotated
        t = y.unflatten(-1, (-1, 2, k)).transpose(-1, -2).flatten(-3)  # type: ignore[no-untyped-call]
        t = t.unflatten(-1, (-1, b))
        t = torch.einsum("kpq,...kq->...kp", _stage(rot[i], s), t)
        t = t.flatten(-2).unflatten(-1, (-1, k, 2))  # type: ignore[no-untyped-call]
        y = t.transpose(-1, -2).flatten(-3)
    return y


def _peft_perm(n: int, blocks: int, half: int) -> torch.Tensor:
    """PEFT's block-butterfly permutation: in each run of n/blocks columns, the even half-blocks, then the
    odd."""
    chunk = n // blocks
    sub = torch.arange(chunk).view(-1, half)
    return (torch.arange(0, n, chunk)[:, None] + torch.cat([sub[0::2], sub[1::2]]).flatten()).flatten()


def _peft_rotate(
    f: BoftFactors, w: torch.Tensor, s: float, transpose: bool, rot: torch.Tensor | None = None
) -> torch.Tensor:
    """M_s·w (or M_sᵀ·w) along the last axis, M = P_{N−1}B_{N−1}P_{N−1}ᵀ···P_0B_0P_0ᵀ; `rot` as in
    _butterfly."""
    rot = _rotations(f, w.device, w.dtype) if rot is None else rot
    stages, d, h = rot.shape[:3]
    for i in reversed(range(stages)) if transpose else range(stages):
        mats = _stage(rot[i], s)
        perm = _peft_perm(d * h, d // 2**i, h // 2).to(w.device) if stages > 1 else None
        u = w if perm is None else w[..., torch.argsort(perm)]  # Pᵀw
        blocked = u.unflatten(-1, (d, h))  # type: ignore[no-untyped-call]  # as in _butterfly
        u = torch.einsum("kpq,...kq->...kp", mats.mT if transpose else mats, blocked).flatten(-2)
        w = u if perm is None else u[..., perm]  # P·u
    return w


def _peft_delta_rows(f: BoftFactors, weight_rows: torch.Tensor, src: int, s: float) -> torch.Tensor:
    """(length, in·k): boft_s ⊙ (W·M_sᵀ) − W for the given original rows."""
    w = weight_rows.flatten(1)
    rot = _peft_rotate(f, w, s, transpose=False)
    assert f.rescale is not None  # load requires PEFT's boft_s
    return rescaled((rot - w).mT, w.mT, f.rescale[src : src + w.shape[0]], s).mT


def add_delta(
    target_rows: torch.Tensor,
    f: BoftFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor,
    **_: object,
) -> None:
    """target_rows (length, in·k) += ΔW at strength s = coeff, from the original rows `base`."""
    base = base.to(target_rows.dtype)
    if f.peft:
        target_rows.add_(_peft_delta_rows(f, base, src, coeff))
        return
    y = base.mT  # LyCORIS rotates rows: they are the channels
    r = None if f.rescale is None else f.rescale[src : src + length]
    target_rows.add_(rescaled(_butterfly(f, y, src, coeff) - y, y, r, coeff).mT)


def bias_delta(f: BoftFactors, src: int, length: int) -> None:
    return None


def check_piece(f: BoftFactors, src: int, length: int) -> Miss | None:
    if not f.peft and (src % f.span or length % f.span):
        return Miss(
            "shape_mismatch",
            f"shape mismatch: rows [{src}, {src + length}) cut a BOFT butterfly of {f.span} rows",
        )
    return None


def runtime_term(f: BoftFactors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    if f.peft and module is None:
        raise PartRejected(
            "unsupported", "unsupported family: PEFT BOFT at runtime needs the host module's weight"
        )
    if not f.peft and (src % f.span or length % f.span):
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: rows [{src}, {src + length}) cut a BOFT butterfly of {f.span} rows",
        )
    r = None if f.rescale is None else f.rescale[src : src + length]
    # the rotations this chunk uses, built once in fp64 (small), held with the rows' rescale
    # (RuntimeTerm.caches); PEFT's conv form keeps a dense ΔW per strength instead (declared `unheld`)
    peft_conv = f.peft and module is not None and module.weight.dim() > 2
    rot = _rotations(f, f.blocks.device, torch.float64)
    b = f.blocks.shape[2]
    rot = rot.clone() if f.peft else rot[:, src // b : (src + length) // b].clone()
    cache = CastCache(rot, *(() if r is None else (r,)))

    def fn(
        x: torch.Tensor,
        conv: ConvSpec | None,
        base: torch.Tensor,
        strength: float | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        if strength is None:
            raise RuntimeError("BOFT is not linear in strength: the runtime must pass it")
        s = strength * scale
        acc = torch.promote_types(base.dtype, torch.float32)
        if (
            f.peft and conv is not None
        ):  # the rotation mixes kernel taps with channels: dense ΔW, last strength kept
            weight = module.weight
            key = (s, x.device, x.dtype, weight._version)
            if key not in f._dense:
                rows = weight.detach()[dst : dst + length].to(x.device, acc)
                f._dense = {key: _peft_delta_rows(f, rows, src, s).view_as(rows).to(x.dtype)}
            return conv.fn(x, f._dense[key], None, **conv.kwargs)
        y = (base if conv is None else base.movedim(1, -1)).to(acc)
        rot_c, *rows = cache.to(y.device, acc)
        if f.peft:  # Linear: y' = F.linear(x·M_s, W_rows)
            weight = module.weight[dst : dst + length]
            turned = _peft_rotate(f, x.to(acc), s, transpose=True, rot=rot_c)
            moved = F.linear(turned.to(weight.dtype), weight).to(acc)
        else:
            moved = _butterfly(f, y, src, s, rot=rot_c)
        d = rescaled(moved - y, y, rows[0] if rows else None, s).to(base.dtype)
        return d if conv is None else d.movedim(-1, 1)

    m, n, b = f.blocks.shape[:3]
    cost = (
        f"PEFT BOFT input rotation ({m} stages of {n}x{b}) + one extra base GEMM"
        if f.peft
        else f"BOFT butterfly on the output ({m} stages of {length // b}x{b}); R cached"
    )
    held = {"unheld": "PEFT BOFT conv: dense ΔW per strength"} if peft_conv else {"caches": (cache,)}
    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        needs_base=True,
        linear_in_strength=False,
        cost=cost,
        **held,
    )


# alpha is the constraint, not a scale
SPEC = Family(
    "boft",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    uses_alpha_scale=False,
    check_piece=check_piece,
)
