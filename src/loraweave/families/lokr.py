"""LoKr (Kronecker product): ΔW = kron(w1, w2); runtime y += γ·vec(w1·X·w2ᵀ), never the full kron.

On the flattened weight (a·b, in·k) every LoKr is kron(w1 (a, c), w2 (b, n)), n = w2's columns with any kernel
dims folded in (LyCORIS's unsqueezed-w1 kron and the older flat 2-D kron are the same matrix). Row i·b+k of ΔW
is w1[i] ⊗ w2[k], so a row chunk of a fused module needs only the w1 rows it spans."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factors

ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


@dataclass
class LokrFactors:
    w1: tuple[torch.Tensor, ...]  # (w1 (a, c),) or (w1_a (a, r), w1_b (r, c)); stored dtype
    w2: tuple[
        torch.Tensor, ...
    ]  # (w2 (b, d, *k),) | (w2_a (b, r), w2_b (r, d·k | d, *k)) | (t2, w2_a (r, b), w2_b (r, d))
    a: int
    c: int
    b: int
    n: int  # columns of the flattened w2 (d·k)
    rank: (
        int | None
    )  # rank of the factored half (w1's first, as LyCORIS); None when both halves are full: γ = 1
    kernel: tuple[int, ...] | None  # kernel dims the factors carry (None: 2-D w2, known only from the target)
    target_kernel: tuple[int, ...] | None = None  # the host module's kernel dims, recorded by check_target

    @property
    def rows(self) -> int:
        return self.a * self.b

    @property
    def is_conv_kernel(self) -> bool:  # kernel larger than 1x1: kohya's conv_alpha applies
        return any(k > 1 for k in (self.target_kernel or self.kernel or ()))


def _half(tensors: dict[str, torch.Tensor], side: str) -> tuple[torch.Tensor, ...]:
    full, fa, fb = (tensors.get(f"lokr_{side}{s}") for s in ("", "_a", "_b"))
    if full is not None and (fa is not None or fb is not None):
        raise PartRejected("shape_mismatch", f"shape mismatch: both lokr_{side} and lokr_{side}_a/_b given")
    if full is not None:
        return (full,)
    if fa is None and fb is None:
        raise PartRejected(
            "incomplete", f"incomplete LoKr: no lokr_{side} (or lokr_{side}_a + lokr_{side}_b)"
        )
    if fa is None or fb is None:
        have, miss = ("a", "b") if fb is None else ("b", "a")
        raise PartRejected("incomplete", f"incomplete LoKr: lokr_{side}_{have} without lokr_{side}_{miss}")
    return fa, fb


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> LokrFactors:
    """Validate shapes and values of one part's tensors (role -> tensor); factors stay in their stored
    dtype."""
    other = sorted(set(tensors) - set(ROLES))
    if other:  # e.g. dora_scale: dropping it would silently change the result
        raise PartRejected(
            "unsupported",
            f"unsupported family: {', '.join(other)} on a LoKr part (not yet supported with LoKr)",
        )
    check_factors(tensors, key_of)
    w1, w2, t2 = _half(tensors, "w1"), _half(tensors, "w2"), tensors.get("lokr_t2")
    shapes = ", ".join(f"{role} {tuple(t.shape)}" for role, t in sorted(tensors.items()))
    bad = PartRejected("shape_mismatch", f"shape mismatch: LoKr factors do not pair ({shapes})")
    if any(t.numel() == 0 for t in tensors.values()):
        raise bad
    a, c, r1 = _w1_shape(w1, bad)
    w2, b, d, kernel, r2 = _w2_shape(w2, t2, bad)
    rank = r1 if r1 is not None else r2
    return LokrFactors(w1, w2, a, c, b, d * math.prod(kernel), rank, kernel or None)


def _w1_shape(w1: tuple[torch.Tensor, ...], bad: PartRejected) -> tuple[int, int, int | None]:
    """(a, c, rank or None) of the first Kronecker half: a full (a, c[, 1, 1]) matrix or factors (a, r) @ (r,
    c)."""
    if len(w1) == 1:
        if w1[0].dim() < 2 or any(k != 1 for k in w1[0].shape[2:]):
            raise bad
        a, c = w1[0].shape[:2]
        return a, c, None
    if w1[0].dim() != 2 or w1[1].dim() != 2 or w1[0].shape[1] != w1[1].shape[0]:
        raise bad
    (a, r1), c = w1[0].shape, w1[1].shape[1]
    return a, c, r1


def _w2_shape(
    w2: tuple[torch.Tensor, ...], t2: torch.Tensor | None, bad: PartRejected
) -> tuple[tuple[torch.Tensor, ...], int, int, tuple[int, ...], int | None]:
    """(the half's tensors, b, d, kernel, rank or None) of the second Kronecker half: Tucker (t2, w2_a, w2_b),
    a full (b, d, *kernel) tensor, or factors (b, r) @ (r, d, *kernel)."""
    if t2 is not None:
        return _tucker_shape(w2, t2, bad)
    if len(w2) == 1:
        if w2[0].dim() < 2:
            raise bad
        return w2, w2[0].shape[0], w2[0].shape[1], tuple(w2[0].shape[2:]), None
    wa, wb = w2
    if wa.dim() != 2 or wb.dim() < 2 or wa.shape[1] != wb.shape[0]:
        raise bad
    return w2, wa.shape[0], wb.shape[1], tuple(wb.shape[2:]), wb.shape[0]


def _tucker_shape(
    w2: tuple[torch.Tensor, ...], t2: torch.Tensor, bad: PartRejected
) -> tuple[tuple[torch.Tensor, ...], int, int, tuple[int, ...], int]:
    """Tucker: w2[p, q, ...] = Σ t2[i, j, ...] · w2_a[i, p] · w2_b[j, q]."""
    if len(w2) != 2:
        raise bad
    wa, wb = w2
    if t2.dim() < 3 or wa.dim() != 2 or wb.dim() != 2 or t2.shape[:2] != (wa.shape[0], wb.shape[0]):
        raise bad
    return (t2, wa, wb), wa.shape[1], wb.shape[1], tuple(t2.shape[2:]), wb.shape[0]


def check_target(f: LokrFactors, shape: tuple[int, ...]) -> Miss | None:
    """Reason the factors cannot land on a module of logical weight shape `shape`, or None (rows: the
    planner)."""
    kernel = tuple(shape[2:])
    cols = shape[1] * math.prod(kernel)
    if f.c * f.n != cols:
        return Miss(
            "shape_mismatch",
            f"shape mismatch: LoKr kron(({f.a}, {f.c}), ({f.b}, {f.n})) has {f.c * f.n} input columns, "
            f"module {tuple(shape)} has {cols}",
        )
    ones = all(k == 1 for k in kernel) and all(k == 1 for k in f.kernel or ())
    if f.kernel is not None and f.kernel != kernel and not ones:
        return Miss("shape_mismatch", f"shape mismatch: LoKr kernel {f.kernel} vs module kernel {kernel}")
    if f.target_kernel is not None and f.target_kernel != kernel:
        return Miss(
            "shape_mismatch",
            f"shape mismatch: LoKr already planned on a kernel {f.target_kernel}, this module has {kernel}",
        )
    return None


def settle(f: LokrFactors, shape: tuple[int, ...]) -> LokrFactors:
    """A 2-D w2 on a conv names no kernel: the runtime form needs the host's, recorded here."""
    return f if f.target_kernel is not None else dataclasses.replace(f, target_kernel=tuple(shape[2:]))


def _w1(f: LokrFactors, dtype: torch.dtype) -> torch.Tensor:
    if len(f.w1) == 1:
        return f.w1[0].reshape(f.a, f.c).to(dtype)
    return f.w1[0].to(dtype) @ f.w1[1].to(dtype)


def _w2(f: LokrFactors, dtype: torch.dtype) -> torch.Tensor:
    """w2 flattened to (b, n)."""
    if len(f.w2) == 1:
        return f.w2[0].reshape(f.b, f.n).to(dtype)
    if len(f.w2) == 2:
        return f.w2[0].to(dtype) @ f.w2[1].reshape(-1, f.n).to(dtype)
    t2, wa, wb = (t.to(dtype) for t in f.w2)
    return torch.einsum("ij...,ip,jq->pq...", t2, wa, wb).reshape(f.b, f.n)


def _window(f: LokrFactors, src: int, length: int) -> tuple[int, int, int]:
    """Rows [src, src+length) of ΔW lie in w1 rows [lo, hi), starting `off` rows into kron(w1[lo:hi], w2)."""
    lo, hi = src // f.b, -(-(src + length) // f.b)
    return lo, hi, src - lo * f.b


def add_delta(target_rows: torch.Tensor, f: LokrFactors, src: int, length: int, coeff: float) -> None:
    """target_rows (length, in*k), fp32/fp64: += coeff · kron(w1, w2)[src:src+length], formed in its dtype."""
    lo, hi, off = _window(f, src, length)
    delta = torch.kron(_w1(f, target_rows.dtype)[lo:hi], _w2(f, target_rows.dtype))
    target_rows.add_(delta[off : off + length], alpha=coeff)


def set_delta(target_rows: torch.Tensor, f: LokrFactors, src: int, length: int, coeff: float) -> None:
    """target_rows = coeff · kron(w1, w2)[src:src+length]: the kron written into the rows themselves where
    they span whole w1 rows (no temporary, no zero pass), else copied from the window's kron."""
    lo, hi, off = _window(f, src, length)
    w1, w2 = _w1(f, target_rows.dtype)[lo:hi], _w2(f, target_rows.dtype)
    if off == 0 and length == (hi - lo) * f.b and target_rows.is_contiguous():
        torch.kron(w1, w2, out=target_rows)
    else:
        target_rows.copy_(torch.kron(w1, w2)[off : off + length])
    if coeff != 1.0:
        target_rows.mul_(coeff)


def bias_delta(f: LokrFactors, src: int, length: int) -> None:
    return None


def _row_squares(half: tuple[torch.Tensor, ...], rows: int, cols: int) -> torch.Tensor:
    """‖row‖² of a full (rows, cols) half, or of a low-rank one A (rows, r) @ B through B's Gram: fp64."""
    if len(half) == 1:
        return half[0].reshape(rows, cols).double().square().sum(1)
    a, b = half[0].double(), half[1].reshape(-1, cols).double()
    return ((a @ (b @ b.T)) * a).sum(1)


def squared_norm(f: LokrFactors, src: int, length: int) -> float:
    """‖kron(w1, w2)[src:src+length]‖² without the kron: row i·b+k is w1[i] ⊗ w2[k], of squared norm
    ‖w1[i]‖²·‖w2[k]‖² (fp64; only a Tucker w2 is formed, at w2's own size)."""
    lo, hi, off = _window(f, src, length)
    w1 = _row_squares(f.w1, f.a, f.c)[lo:hi]
    w2 = _row_squares(f.w2, f.b, f.n) if len(f.w2) < 3 else _w2(f, torch.float64).square().sum(1)
    return float((w1[:, None] * w2[None, :]).flatten()[off : off + length].sum())


def _straddle(f: LokrFactors, w2: torch.Tensor, kernel: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat-layout conv LoKr (n not a multiple of the kernel size): w1 column j covers flattened input columns
    [j·n, (j+1)·n), which straddle channels. Gather each group's channel window (c groups of `span` channels)
    and place w2 at its offset inside a (c·b, span, *k) grouped-conv weight."""
    size, j = math.prod(kernel), torch.arange(f.c)
    start = j * f.n // size
    span = int((((j + 1) * f.n - 1) // size - start).max()) + 1
    index = (start[:, None] + torch.arange(span)).clamp(max=f.c * f.n // size - 1).flatten()
    cols = (j * f.n - start * size)[:, None] + torch.arange(f.n)
    weight = w2.new_zeros(f.c, f.b, span * size)
    weight.scatter_(2, cols[:, None, :].expand(f.c, f.b, f.n), w2.expand(f.c, f.b, f.n))
    return index, weight.view(f.c * f.b, span, *kernel)


def runtime_term(f: LokrFactors, src: int, dst: int, length: int) -> RuntimeTerm:
    """Structured runtime form: Linear y = vec(w1·X·w2ᵀ) on x viewed (…, c, n); conv: c channel groups share
    w2 (one grouped conv), then w1 mixes the groups. Only the w1 rows the chunk spans are used."""
    lo, hi, off = _window(f, src, length)
    acc = torch.float64 if any(t.dtype == torch.float64 for t in (*f.w1, *f.w2)) else torch.float32
    w1, w2 = _w1(f, acc)[lo:hi], _w2(f, acc)
    rows = hi - lo
    kernel = f.target_kernel if f.target_kernel is not None else f.kernel or ()
    size = math.prod(kernel)
    aligned = f.n % size == 0
    index_of: dict[torch.device, torch.Tensor] = {}  # the straddle gather index per device (built once here)
    extra: tuple[torch.Tensor, ...] = ()
    if kernel:  # conv host; flat-layout files whose w2 columns straddle channels gather channel windows
        if not aligned:
            index, straddled = _straddle(f, w2, kernel)
            index_of[index.device] = index
            extra = (straddled,)
        cost = f"LoKr grouped conv ({f.c} groups, w2 {f.b}x{f.n}) + w1 mix ({rows}x{f.c}); no kron"
    elif len(f.w2) == 2 and 4 * f.w2[0].shape[1] * (f.b + f.n) <= f.b * f.n:
        # keep a low-rank w2 factored only where it cuts w2's MACs 4x: the extra pass over (…, c, r) costs
        # memory
        extra = (f.w2[0].to(acc), f.w2[1].reshape(-1, f.n).to(acc))
    w2_first = f.c * f.b * f.n + rows * f.c * f.b <= rows * f.c * f.n + rows * f.n * f.b
    if not kernel:
        w2_macs = f.c * (f.b * f.n if not extra else extra[1].shape[0] * (f.n + f.b))
        macs = w2_macs + (rows * f.c * f.b if w2_first else rows * f.c * f.n)
        cost = f"LoKr w1·X·w2ᵀ: {macs} MACs/token vs {length * f.c * f.n} dense; no kron"
    cache = CastCache(w1, w2, *extra)

    def mul_w2(h: torch.Tensor, w2c: torch.Tensor, low: list[torch.Tensor]) -> torch.Tensor:
        return h @ low[1].mT @ low[0].mT if low else h @ w2c.mT

    def fn(x: torch.Tensor, conv: ConvSpec | None) -> torch.Tensor:
        w1c, w2c, *more = cache.get(x)
        if conv is None:
            xs = x.reshape(*x.shape[:-1], f.c, f.n)
            y = (
                torch.matmul(w1c, mul_w2(xs, w2c, more))
                if w2_first
                else mul_w2(torch.matmul(w1c, xs), w2c, more)
            )
            y = y.flatten(-2)
            return y if (off, length) == (0, y.shape[-1]) else y[..., off : off + length]
        if not kernel:
            raise RuntimeError(
                "LoKr with a 2-D w2 on a conv: kernel unknown (plan it with check_target first)"
            )
        n, spatial = x.shape[0], x.shape[2:]
        if aligned:  # channels j·d..(j+1)·d form group j: fold the groups into the batch
            d = f.n // size
            h = conv.fn(x.reshape(n * f.c, d, *spatial), w2c.view(f.b, d, *kernel), None, **conv.kwargs)
        else:
            if x.device not in index_of:
                index_of[x.device] = next(iter(index_of.values())).to(x.device)
            h = conv.fn(x.index_select(1, index_of[x.device]), more[0], None, groups=f.c, **conv.kwargs)
        out_spatial = h.shape[2:]
        y = torch.matmul(w1c, h.reshape(n, f.c, -1)).view(n, rows * f.b, *out_spatial)
        return y if (off, length) == (0, y.shape[1]) else y[:, off : off + length]

    return RuntimeTerm.structured(dst, length, fn=fn, cost=cost, caches=(cache,))


SPEC = Family(
    "lokr",
    load,
    check_target,
    add_delta,
    bias_delta,
    runtime_term,
    settle=settle,
    roles=ROLES,
    set_delta=set_delta,
    squared_norm=squared_norm,
)
