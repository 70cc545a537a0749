"""OFT: blockwise rotation of the output rows, W' = rescale ⊙ blockdiag(R_s)ᵀ·W with R_s = s·R + (1−s)·I.

On-disk forms (formats-and-math §5), one math:
- LyCORIS >= 3 diag-oft: `oft_blocks` (n, b, b), R = Cayley(Q), Q = B − Bᵀ. `alpha` is the constraint, c = α·rows:
  if c > 0 and ‖Q‖_F + 1e-8 > c (norm over all blocks), Q ← Q·c/(‖Q‖+1e-8). α ≤ 0 or no alpha = unconstrained
  (LyCORIS's default; clamping to 0 instead nulls the adapter, the SD.Next defect). Optional `rescale` per row.
- LyCORIS 2.x `oft_diag` (n, b, b): R itself (rescale folded in); no Cayley, no constraint.
- kohya COFT (`oft_unet_*`): `oft_blocks` as above (kohya's clamp equals LyCORIS's to 1e-8 for α > 0);
  kohya Flux saves one `oft_blocks.<i>` per output split, each rotated on its own with c_i = α·split_i.
A 4-D `oft_blocks` is BOFT: load hands it to boft.load and every function here passes BOFT factors on.
PEFT OFT (`oft_R.weight`, an INPUT rotation whose form depends on adapter_config.json) lives in peft_oft.py:
load hands `oft_R` parts to it, with the PEFT config when the planner passes one, and every function passes its
factors on.

Strength s enters once, as LyCORIS's multiplier: R_s = s·R + (1−s)·I (kohya's s(R−I)+I is the same), so s = 0 is
the identity and s < 0 rotates backwards; without rescale ΔW = s·(Rᵀ−I)W is linear in s. `rescale` is applied in
full at every strength, as LyCORIS's forward does (so s = 0 still scales a rescaled file's rows);
RESCALE_FOLLOWS_STRENGTH = True uses 1 + s·(rescale − 1) instead. Merge and runtime share one formula; runtime
rotates the pre-bias output channels (LyCORIS's bypass rotates the bias too and drops rescale: not repeated)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .base import PartRejected, RuntimeTerm, check_factor

FAMILY = "oft"
USES_ALPHA_SCALE = False  # alpha is the constraint, not a scale
NEEDS_BASE = True
RESCALE_FOLLOWS_STRENGTH = False  # False: LyCORIS (rescale in full at any strength); True: 1 + s·(rescale − 1)
_SPLIT_ROLE = re.compile(r"oft_blocks\.(\d+)")


@dataclass
class OftFactors:
    segments: list[tuple[torch.Tensor, float]]  # per output split, top to bottom: (blocks (n, b, b), constraint)
    cayley: bool  # False: the blocks are R itself (LyCORIS 2.x oft_diag)
    rescale: torch.Tensor | None  # (rows,), stored dtype
    _minus_i: dict = field(default_factory=dict)  # device -> [R − I per segment], built on first use

    @property
    def rows(self) -> int:
        return sum(blocks.shape[0] * blocks.shape[1] for blocks, _ in self.segments)


def acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def cayley(blocks: torch.Tensor, constraint: float, dtype: torch.dtype) -> torch.Tensor:
    """LyCORIS's R = (I + Q)(I − Q)⁻¹ for Q = B − Bᵀ, Q scaled onto the sphere ‖Q‖ = c when c > 0 and it lies outside."""
    b = blocks.to(dtype)
    q = b - b.transpose(-1, -2)
    if constraint > 0:
        norm = float(torch.linalg.vector_norm(q)) + 1e-8
        if norm > constraint:
            q = q * (constraint / norm)
    eye = torch.eye(q.shape[-1], dtype=dtype)
    return (eye + q) @ torch.linalg.inv(eye - q)


def scalar_alpha(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> float:
    """The constraint α from the `alpha` tensor; missing (or meta, shape-only planning) reads as 0 = unconstrained."""
    alpha = tensors.get("alpha")
    if alpha is None:
        return 0.0
    if alpha.numel() != 1:
        raise PartRejected(f"shape mismatch: {key_of['alpha']} should be a scalar, has shape {tuple(alpha.shape)}")
    value = 0.0 if alpha.device.type == "meta" else float(alpha.reshape(()).double())  # int/fp64 alphas too
    if value != value or value in (float("inf"), float("-inf")):
        raise PartRejected(f"bad tensor: {key_of['alpha']} is not finite")
    return value


def row_scale(rescale: torch.Tensor | None, rows: int, key: str) -> torch.Tensor | None:
    """rescale / boft_s: one factor per output row, stored (rows, 1[, 1…]) or (1, rows); flattened to (rows,)."""
    if rescale is None:
        return None
    if rescale.numel() != rows or max(rescale.shape, default=0) != rows:
        raise PartRejected(f"shape mismatch: {key} {tuple(rescale.shape)} is not one factor per row of {rows}")
    return rescale.reshape(rows)


def rescaled(delta: torch.Tensor, y: torch.Tensor, rescale: torch.Tensor | None, s: float) -> torch.Tensor:
    """rescale ⊙ (y + delta) − y, channels last; the rescale at strength s per RESCALE_FOLLOWS_STRENGTH."""
    if rescale is None:
        return delta
    r = rescale.to(y.device, y.dtype)
    if RESCALE_FOLLOWS_STRENGTH:
        r = 1 + s * (r - 1)
    return r * delta + (r - 1) * y


def _other(f):
    """The module owning factors of another form (BOFT, PEFT OFT), or None for this file's OftFactors."""
    if isinstance(f, OftFactors):
        return None
    from . import peft_oft

    if isinstance(f, peft_oft.PeftOftFactors):
        return peft_oft
    from . import boft

    return boft


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str], config: dict | None = None):
    """Validate one part's tensors (role -> tensor); a 4-D `oft_blocks` goes to BOFT, `oft_R` to PEFT OFT.

    config: the adapter's PEFT config fields (adapter_config.json / `lora_adapter_metadata`), read by PEFT OFT
    only; None means PEFT 0.21's defaults."""
    blocks = tensors.get("oft_blocks")
    if blocks is not None and blocks.dim() == 4:
        from . import boft

        return boft.load(tensors, key_of)
    if "oft_R" in tensors:
        from . import peft_oft

        return peft_oft.load(tensors, key_of, config)
    splits = sorted((int(m[1]), role) for role in tensors if (m := _SPLIT_ROLE.fullmatch(role)))
    kinds = [k for k in ("oft_blocks", "oft_diag") if k in tensors] + (["oft_blocks.<i>"] if splits else [])
    if len(kinds) != 1:
        raise PartRejected("incomplete OFT: no oft_blocks or oft_diag" if not kinds
                           else f"shape mismatch: OFT part holds both {' and '.join(kinds)}")
    extra = set(tensors) - {"oft_blocks", "oft_diag", "rescale", "alpha", *(r for _, r in splits)}
    if extra:
        raise PartRejected(f"unsupported family: OFT part with {', '.join(sorted(key_of[r] for r in extra))}")
    for role, t in tensors.items():
        if role != "alpha":
            check_factor(key_of[role], t)
    roles = [r for _, r in splits] or kinds
    for role in roles:
        t = tensors[role]
        if t.dim() != 3 or t.shape[1] != t.shape[2] or 0 in t.shape:
            raise PartRejected(f"shape mismatch: {key_of[role]} {tuple(t.shape)} is not (blocks, b, b)")
    alpha = scalar_alpha(tensors, key_of)
    # c = α·(rows the blocks rotate): the module's out_dim, or one split's width for kohya Flux.
    segments = [(tensors[r], alpha * tensors[r].shape[0] * tensors[r].shape[1]) for r in roles]
    rows = sum(t.shape[0] * t.shape[1] for t, _ in segments)
    return OftFactors(segments, "oft_diag" not in tensors, row_scale(tensors.get("rescale"), rows, key_of.get("rescale")))


def check_target(f, shape: tuple[int, ...]) -> str | None:
    """The planner checks the total rows; a fused chunk must not cut a block (offsets are checked when applied)."""
    if (other := _other(f)) is not None:
        return other.check_target(f, shape)
    smallest = min(blocks.shape[1] for blocks, _ in f.segments)
    if shape[0] % smallest:
        return f"shape mismatch: OFT blocks of {smallest} rows do not tile a module of {shape[0]} rows"
    return None


def check_piece(f, src: int, length: int) -> str | None:
    if (other := _other(f)) is not None:
        return other.check_piece(f, src, length)
    try:
        _windows(f, src, length)
    except PartRejected as rejected:
        return str(rejected)
    return None


def _windows(f: OftFactors, src: int, length: int):
    """(segment index, first block, block count, offset into the slice) for rows [src, src+length)."""
    out, start = [], 0
    for i, (blocks, _) in enumerate(f.segments):
        n, b = blocks.shape[:2]
        lo, hi = max(src, start), min(src + length, start + n * b)
        if lo < hi:
            if (lo - start) % b or (hi - start) % b:
                raise PartRejected(f"shape mismatch: rows [{src}, {src + length}) cut an OFT block of {b} rows")
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
    parts = []
    for i, k0, count, off in _windows(f, src, y.shape[-1]):
        b = mats[i].shape[-1]
        yk = y[..., off : off + count * b].unflatten(-1, (count, b))
        parts.append(torch.einsum("knm,...kn->...km", mats[i][k0 : k0 + count] * s, yk).flatten(-2))
    delta = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
    return rescaled(delta, y, None if f.rescale is None else f.rescale[src : src + y.shape[-1]], s)


def add_delta(target_rows: torch.Tensor, f, src: int, length: int, coeff: float, base: torch.Tensor, **_) -> None:
    """target_rows (length, in·k) += rescale ⊙ (R_sᵀ W) − W for the original rows `base` (fp32), s = coeff."""
    if (other := _other(f)) is not None:
        return other.add_delta(target_rows, f, src, length, coeff, base)
    y = base.to(target_rows.dtype).mT  # rows are the channels: (in·k, length)
    target_rows.add_(_delta(f, y, src, coeff).mT)


def bias_delta(f, src: int, length: int) -> None:
    return None  # the rotation acts on the weight only; the bias is untouched (LyCORIS, kohya)


def runtime_term(f, src: int, dst: int, length: int, module: torch.nn.Module | None = None) -> RuntimeTerm:
    """Rotate the pre-bias output channels: Δy = rescale ⊙ (R_sᵀ y) − y (channel axis last, or 1 for conv)."""
    if (other := _other(f)) is not None:
        return other.runtime_term(f, src, dst, length, module)
    windows = _windows(f, src, length)  # rejects a chunk that cuts a block before anything is attached
    linear = f.rescale is None  # ΔW = s·(Rᵀ − I)W: the runtime scales the s = 1 term itself

    def fn(x, conv, base, strength=None, scale=1.0):
        if not linear and strength is None:
            raise RuntimeError("OFT with rescale is not linear in strength: the runtime must pass it")
        s = 1.0 if linear else strength * scale
        y = base if conv is None else base.movedim(1, -1)
        acc = torch.promote_types(y.dtype, torch.float32)
        d = _delta(f, y.to(acc), src, s).to(y.dtype)
        return d if conv is None else d.movedim(-1, 1)

    sizes = ", ".join(f"{count}x{f.segments[i][0].shape[-1]}" for i, _, count, _ in windows)
    return RuntimeTerm(None, None, None, None, dst, length, fn=fn, needs_base=True, linear_in_strength=linear,
                       cost=f"OFT blockwise rotation of the output ({sizes} blocks); R cached")
