"""OFT: blockwise rotation of the output rows, W' = rescale ⊙ blockdiag(R_s)ᵀ·W with R_s = s·R + (1−s)·I.

Three on-disk forms (PEFT's, an input rotation, is peft_oft.py), one math:
- LyCORIS >= 3 diag-oft: `oft_blocks` (n, b, b), R = Cayley(Q), Q = B − Bᵀ. `alpha` is the constraint, c =
  α·rows: if c > 0 and ‖Q‖_F + 1e-8 > c (norm over all blocks), Q ← Q·c/(‖Q‖+1e-8). α ≤ 0 or no alpha =
  unconstrained (LyCORIS's default; clamping to 0 instead nulls the adapter, the SD.Next defect). Optional
  `rescale` per row.
- LyCORIS 2.x `oft_diag` (n, b, b): R itself (rescale folded in); no Cayley, no constraint.
- kohya COFT (`oft_unet_*`): `oft_blocks` as above (kohya's clamp equals LyCORIS's to 1e-8 for α > 0);
  kohya Flux saves one `oft_blocks.<i>` per output split, each rotated on its own with c_i = α·split_i.
A 4-D `oft_blocks` is BOFT (boft.py); PEFT OFT (`oft_R.weight`, an INPUT rotation whose form depends on
adapter_config.json) is peft_oft.py. The planner picks the variant from the keys and shapes
(families.family_for).

Strength s enters once, as LyCORIS's multiplier: R_s = s·R + (1−s)·I (kohya's s(R−I)+I is the same), so s = 0
is the identity and s < 0 rotates backwards; without rescale ΔW = s·(Rᵀ−I)W is linear in s. `rescale` is
applied in full at every strength, as LyCORIS's forward does (so s = 0 still scales a rescaled file's rows);
RESCALE_FOLLOWS_STRENGTH = True uses 1 + s·(rescale − 1) instead. Merge and runtime share one formula; runtime
rotates the pre-bias output channels (LyCORIS's bypass rotates the bias too and drops rescale: not
repeated)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factors, refuse_roles
from .oft_common import acc_dtype, cayley, rescaled, row_scale, scalar_alpha

_SPLIT_ROLE = re.compile(r"oft_blocks\.(\d+)")


@dataclass
class OftFactors:
    segments: list[
        tuple[torch.Tensor, float]
    ]  # per output split, top to bottom: (blocks (n, b, b), constraint)
    cayley: bool  # False: the blocks are R itself (LyCORIS 2.x oft_diag)
    rescale: torch.Tensor | None  # (rows,), stored dtype
    # (device, dtype) -> [R − I per segment], built on first use
    _minus_i: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(blocks.shape[0] * blocks.shape[1] for blocks, _ in self.segments)


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> OftFactors:
    """Validate one part's tensors (role -> tensor). 4-D `oft_blocks` (BOFT) and `oft_R` (PEFT OFT) parts are
    sent to their own families by the planner (families.family_for)."""
    splits = sorted((int(m[1]), role) for role in tensors if (m := _SPLIT_ROLE.fullmatch(role)))
    kinds = [k for k in ("oft_blocks", "oft_diag") if k in tensors] + (["oft_blocks.<i>"] if splits else [])
    if len(kinds) != 1:
        if not kinds:
            raise PartRejected("incomplete", "incomplete OFT: no oft_blocks or oft_diag")
        raise PartRejected("shape_mismatch", f"shape mismatch: OFT part holds both {' and '.join(kinds)}")
    refuse_roles(
        "OFT", set(tensors) - {"oft_blocks", "oft_diag", "rescale", "alpha", *(r for _, r in splits)}, key_of
    )
    check_factors(tensors, key_of, skip=("alpha",))
    roles = [r for _, r in splits] or kinds
    for role in roles:
        t = tensors[role]
        if t.dim() != 3 or t.shape[1] != t.shape[2] or 0 in t.shape:
            raise PartRejected(
                "shape_mismatch", f"shape mismatch: {key_of[role]} {tuple(t.shape)} is not (blocks, b, b)"
            )
    alpha = scalar_alpha(tensors, key_of)
    # c = α·(rows the blocks rotate): the module's out_dim, or one split's width for kohya Flux.
    segments = [(tensors[r], alpha * tensors[r].shape[0] * tensors[r].shape[1]) for r in roles]
    rows = sum(t.shape[0] * t.shape[1] for t, _ in segments)
    return OftFactors(
        segments, "oft_diag" not in tensors, row_scale(tensors.get("rescale"), rows, key_of.get("rescale"))
    )


def check_target(f: OftFactors, shape: tuple[int, ...]) -> Miss | None:
    """The planner checks the total rows; a fused chunk must not cut a block (offsets are checked when
    applied)."""
    smallest = min(blocks.shape[1] for blocks, _ in f.segments)
    if shape[0] % smallest:
        return Miss(
            "shape_mismatch",
            f"shape mismatch: OFT blocks of {smallest} rows do not tile a module of {shape[0]} rows",
        )
    return None


def check_piece(f: OftFactors, src: int, length: int) -> Miss | None:
    try:
        _windows(f, src, length)
    except PartRejected as rejected:
        return rejected.miss
    return None


Window = tuple[int, int, int, int]  # segment index, first block, block count, offset into the slice


def _windows(f: OftFactors, src: int, length: int) -> list[Window]:
    """(segment index, first block, block count, offset into the slice) for rows [src, src+length)."""
    out: list[Window] = []
    start = 0
    for i, (blocks, _) in enumerate(f.segments):
        n, b = blocks.shape[:2]
        lo, hi = max(src, start), min(src + length, start + n * b)
        if lo < hi:
            if (lo - start) % b or (hi - start) % b:
                raise PartRejected(
                    "shape_mismatch",
                    f"shape mismatch: rows [{src}, {src + length}) cut an OFT block of {b} rows",
                )
            out.append((i, (lo - start) // b, (hi - lo) // b, lo - src))
        start += n * b
    return out


def _rotation_minus_i(f: OftFactors, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    key = (device, dtype)
    if key not in f._minus_i:
        acc = torch.promote_types(acc_dtype(*(b for b, _ in f.segments)), dtype)
        mats = [cayley(b, c, acc) if f.cayley else b.to(acc) for b, c in f.segments]
        f._minus_i[key] = [(r - torch.eye(r.shape[-1], dtype=acc)).to(device, dtype) for r in mats]
    return f._minus_i[key]


def _delta(f: OftFactors, y: torch.Tensor, src: int, s: float) -> torch.Tensor:
    """rescale ⊙ (blockdiag(R_s)ᵀ y) − y for channels-last y holding rows [src, src + y.shape[-1])."""
    mats = _rotation_minus_i(f, y.device, y.dtype)
    windows = _windows(f, src, y.shape[-1])
    used = [mats[i][k0 : k0 + count] for i, k0, count, _ in windows]
    return _rotated(used, windows, None if f.rescale is None else f.rescale[src : src + y.shape[-1]], y, s)


def _rotated(
    mats: list[torch.Tensor], windows: list[Window], rescale: torch.Tensor | None, y: torch.Tensor, s: float
) -> torch.Tensor:
    """The delta of `_delta` from the R − I blocks each window uses (`mats`, in window order)."""
    parts = []
    for m, (_, _, count, off) in zip(mats, windows, strict=True):
        window = y[..., off : off + count * m.shape[-1]]
        # torch leaves Tensor.unflatten unannotated
        yk = window.unflatten(-1, (count, m.shape[-1]))  # type: ignore[no-untyped-call]
        parts.append(torch.einsum("knm,...kn->...km", m * s, yk).flatten(-2))
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
    return rescaled(delta, y, rescale, s)


def add_delta(
    target_rows: torch.Tensor,
    f: OftFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor,
    **_: object,
) -> None:
    """target_rows (length, in·k) += rescale ⊙ (R_sᵀ W) − W for the original rows `base` (fp32), s = coeff."""
    y = base.to(target_rows.dtype).mT  # rows are the channels: (in·k, length)
    target_rows.add_(_delta(f, y, src, coeff).mT)


def bias_delta(f: OftFactors, src: int, length: int) -> None:
    return None  # the rotation acts on the weight only; the bias is untouched (LyCORIS, kohya)


def runtime_term(f: OftFactors, src: int, dst: int, length: int) -> RuntimeTerm:
    """Rotate the pre-bias output channels: Δy = rescale ⊙ (R_sᵀ y) − y (channel axis last, or 1 for conv)."""
    windows = _windows(f, src, length)  # rejects a chunk that cuts a block before anything is attached
    linear = f.rescale is None  # ΔW = s·(Rᵀ − I)W: the runtime scales the s = 1 term itself
    # R − I of the blocks this chunk uses, built once in fp64 (n·b² per layer: small; any compute dtype is
    # then exact to its rounding) and held with the rows' rescale (RuntimeTerm.caches): the forward reads
    # their casts
    mats = _rotation_minus_i(f, f.segments[0][0].device, torch.float64)
    used = [mats[i][k0 : k0 + count].clone() for i, k0, count, _ in windows]
    rows = () if f.rescale is None else (f.rescale[src : src + length],)
    cache = CastCache(*used, *rows)

    def fn(
        x: torch.Tensor,
        conv: ConvSpec | None,
        base: torch.Tensor,
        strength: float | None = None,
        scale: float = 1.0,
    ) -> torch.Tensor:
        if linear:
            s = 1.0
        elif strength is None:
            raise RuntimeError("OFT with rescale is not linear in strength: the runtime must pass it")
        else:
            s = strength * scale
        y = base if conv is None else base.movedim(1, -1)
        acc = torch.promote_types(y.dtype, torch.float32)
        (*held,) = cache.to(y.device, acc)
        rescale = held.pop() if rows else None
        d = _rotated(held, windows, rescale, y.to(acc), s).to(y.dtype)
        return d if conv is None else d.movedim(-1, 1)

    sizes = ", ".join(f"{count}x{f.segments[i][0].shape[-1]}" for i, _, count, _ in windows)
    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        needs_base=True,
        linear_in_strength=linear,
        cost=f"OFT blockwise rotation of the output ({sizes} blocks); R cached",
        caches=(cache,),
    )


# alpha is the constraint, not a scale
SPEC = Family(
    "oft",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    runtime_term=runtime_term,
    uses_alpha_scale=False,
    check_piece=check_piece,
)
