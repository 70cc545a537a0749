"""DoRA over an inner LoRA / LoHa / LoKr: W' = a ⊙ W_c with W_c = W + c·ΔW and a from ‖W_c‖.

W is always the ORIGINAL weight (never a partly patched one). The magnitude key picks the convention:
- `dora_scale` (LyCORIS 4.x `weight_decompose`, kohya): c = γ, the file scale, whatever the strength s.
  g = d / (‖W_c‖ + eps_fp32) and a = s·(g − 1) + 1, so at s = 0 the weight is W_c, not W.
  Output axis `(out, 1, …)` (`wd_on_out`, the default): the norm is per output row over all input dims.
  Input axis `(1, in, 1, …)`: the norm is per input channel over (out, *k). It needs every row of the
  adapter, so a piece holding only some of them (a fused-key adapter split over modules) is refused.
  A 1-D `dora_scale` is read as the output axis.
- `lora_magnitude_vector` (PEFT) and `.magnitude` (ai-toolkit's copy of PEFT's vector; `(out,)`, conv
  `(1, out, 1, …)`; always the output axis): c = s·γ and a = d / ‖W_c‖ with no eps. PEFT's `set_scale`
  puts the strength inside the norm.
Runtime: y += (a−1)⊙(Wx) + a·c⊙(ΔW x), with ΔW x on the inner family's structured path. The output
axis is row-local, so fused slices are exact. a is computed from module.weight in row blocks, once per
(s, c), into a held tensor (RuntimeTerm.caches) that each forward reads cast."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..formats.keys import peft_magnitude
from ..report.miss import Miss
from . import loha, lokr, lora
from .base import CastCache, ConvSpec, Factors, Family, PartRejected, RuntimeTerm, Shape, check_factor

_INNER = {"lora": lora, "loha": loha, "lokr": lokr}
_EPS = torch.finfo(torch.float32).eps  # LyCORIS adds eps of dora_scale's dtype: fp32 in its modules
BLOCK = 2**24  # elements of W_c formed at once when the runtime path computes its gain


@dataclass
class DoraFactors:
    kind: str  # inner family: "lora" | "loha" | "lokr"
    inner: object  # the inner family's factors
    magnitude: torch.Tensor  # d flattened: (rows,) on the output axis, (in,) on the input axis
    on_out: bool
    peft: bool  # PEFT convention (lora_magnitude_vector) instead of LyCORIS's

    rows = property(lambda self: self.inner.rows)
    rank = property(lambda self: self.inner.rank)  # the planner's γ = alpha / rank
    is_conv_kernel = property(lambda self: self.inner.is_conv_kernel)


def _kind(role: str) -> str:
    if role.startswith("hada_"):
        return "loha"
    if role.startswith("lokr_"):
        return "lokr"
    if role in ("down", "up", "mid", "up_bias"):
        return "lora"
    raise PartRejected("unsupported", f"unsupported family: DoRA over {role} (only LoRA, LoHa, LoKr)")


def _inner_kind(tensors: dict[str, torch.Tensor]) -> str:
    """The one family the part's factors (all but the magnitude) belong to."""
    kinds = {_kind(r) for r in tensors if r != "dora_scale"}
    if len(kinds) != 1:
        raise PartRejected(
            "incomplete", f"incomplete DoRA: magnitude with {' + '.join(sorted(kinds)) or 'no factors'}"
        )
    return kinds.pop()


def _on_out(d: torch.Tensor, rows: int, peft: bool, key: str) -> bool:
    """Whether magnitude `d` runs along the output rows (else along the input channels), by its shape."""
    if peft:  # PEFT's vector is always on the output axis, its rows along at most one dim
        if d.numel() == rows and sum(n != 1 for n in d.shape) <= 1:
            return True
    elif d.shape == (rows,) or (d.dim() >= 2 and d.shape[0] == rows and d[0].numel() == 1):
        return True
    elif d.dim() >= 2 and d.shape[0] == 1 and all(n == 1 for n in d.shape[2:]):
        return False  # (1, in, 1, …): checked against the module's input channels in check_target
    raise PartRejected("shape_mismatch", f"shape mismatch: {key} {tuple(d.shape)} for {rows} output rows")


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> DoraFactors:
    """Load the inner family from its roles, then validate `dora_scale` against its rows."""
    d = tensors.get("dora_scale")
    if d is None:
        raise PartRejected("incomplete", "incomplete DoRA: no dora_scale / lora_magnitude_vector tensor")
    kind = _inner_kind(tensors)
    if "up_bias" in tensors:
        raise PartRejected(
            "unsupported", "unsupported family: DoRA with a LoRA bias (lora_B.bias); PEFT refuses it too"
        )
    check_factor(key_of["dora_scale"], d)
    inner = _INNER[kind].load({r: t for r, t in tensors.items() if r != "dora_scale"}, key_of)
    peft = peft_magnitude(key_of["dora_scale"])
    on_out = _on_out(d, inner.rows, peft, key_of["dora_scale"])
    return DoraFactors(kind, inner, d.reshape(-1), on_out, peft)


def check_target(f: DoraFactors, shape: Shape) -> Miss | None:
    reason: Miss | None = _INNER[f.kind].SPEC.check_target(f.inner, shape)
    if reason or f.on_out:
        return reason
    if shape[1] != f.magnitude.numel():
        return Miss(
            "shape_mismatch",
            f"shape mismatch: input-axis dora_scale has {f.magnitude.numel()} channels, module {shape[1]}",
        )
    if shape[0] < f.rows:
        return Miss(
            "unsupported",
            f"input-axis DoRA not row-local: its norm spans all {f.rows} adapter rows, this module holds "
            f"{shape[0]} (a fused-key adapter split over modules)",
        )
    return None


def settle(f: DoraFactors, shape: Shape) -> DoraFactors:
    inner = _INNER[f.kind].SPEC.settle(f.inner, shape)
    return f if inner is f.inner else dataclasses.replace(f, inner=inner)


def runtime_refusal(f: DoraFactors, module: Any) -> Miss | None:  # the host or its dequantized view
    """DoRA's runtime gain reads the layer's plain floating weight for its norm."""
    w: Any = getattr(module, "weight", None)
    if type(w) not in (torch.Tensor, torch.nn.Parameter) or not w.is_floating_point() or w.is_meta:
        what = (
            "missing" if w is None else "offloaded (meta)" if w.is_meta else f"a {type(w).__name__} {w.dtype}"
        )
        return Miss(
            "unsupported", f"DoRA runtime reads the layer's weight for its norm; the weight is {what}"
        )
    return None


def check_piece(f: DoraFactors, src: int, length: int) -> Miss | None:
    if not f.on_out and length != f.rows:
        return Miss(
            "unsupported", f"input-axis DoRA not row-local: a piece of {length} of {f.rows} adapter rows"
        )
    return None


def _whole(f: DoraFactors, length: int) -> None:
    if not f.on_out and length != f.rows:
        raise PartRejected(
            "unsupported", f"input-axis DoRA not row-local: a piece of {length} of {f.rows} adapter rows"
        )


def _on(inner: Factors, device: torch.device) -> Factors:
    """The inner factors with every tensor on `device` (inner families compute on their factors' device)."""
    fields = [k.name for k in dataclasses.fields(inner) if k.init]
    values = {k: getattr(inner, k) for k in fields}
    flat = [t for v in values.values() for t in (v if isinstance(v, tuple) else (v,))]
    if all(t.device == device for t in flat if isinstance(t, torch.Tensor)):
        return inner

    def move(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(map(move, v))
        return v.to(device) if isinstance(v, torch.Tensor) else v

    return dataclasses.replace(inner, **{k: move(v) for k, v in values.items()})


def _coeffs(f: DoraFactors, strength: float | None, scale: float | None, coeff: float) -> tuple[float, float]:
    """(s, c): PEFT needs only c = s·γ (= coeff); LyCORIS needs s and γ apart."""
    if f.peft:
        return 1.0, coeff if strength is None or scale is None else strength * scale
    if strength is None or scale is None:
        raise TypeError("DoRA (dora_scale) is not linear in strength: add_delta needs strength= and scale=")
    return strength, scale


def _gain(f: DoraFactors, sumsq: torch.Tensor, d: torch.Tensor, s: float) -> torch.Tensor:
    """a from the squared norms of W_c and the magnitude d, both in the compute dtype."""
    if f.peft:
        return d / sumsq.sqrt()
    g = d / (sumsq.sqrt() + _EPS)
    return g if s == 1 else (g - 1) * s + 1  # LyCORIS interpolates only when the multiplier is not 1


def _sumsq(f: DoraFactors, wc: torch.Tensor) -> torch.Tensor:
    """Squared norms of W_c (length, in*k): per row (output axis) or this block's share per input channel."""
    if f.on_out:
        return wc.square().sum(1)
    return wc.view(wc.shape[0], f.magnitude.numel(), -1).square().sum((0, 2))


def _magnitude(f: DoraFactors, src: int, length: int, like: torch.Tensor) -> torch.Tensor:
    return (f.magnitude[src : src + length] if f.on_out else f.magnitude).to(like.device, like.dtype)


def add_delta(
    target_rows: torch.Tensor,
    f: DoraFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor | None = None,
    strength: float | None = None,
    scale: float | None = None,
) -> None:
    """target_rows (length, in*k) += W' − W for rows [src, src+length); W = `base`, the original rows."""
    if base is None:
        raise TypeError("DoRA needs the original weight rows: add_delta(..., base=W_rows)")
    _whole(f, length)
    s, c = _coeffs(f, strength, scale, coeff)
    wc = base.to(target_rows.dtype, copy=True)
    _INNER[f.kind].add_delta(wc, _on(f.inner, wc.device), src, length, c)
    a = _gain(f, _sumsq(f, wc), _magnitude(f, src, length, wc), s)
    a = a[:, None] if f.on_out else a.repeat_interleave(wc.shape[1] // a.numel())
    target_rows.add_(wc.mul_(a).sub_(base.to(wc.dtype)))


def bias_delta(f: DoraFactors, src: int, length: int) -> None:
    return None


def _tensors_of(inner: Factors) -> list[torch.Tensor]:
    """Every tensor of the inner factors (init fields, tuples flattened), in field order."""
    out: list[torch.Tensor] = []
    for k in dataclasses.fields(inner):
        v = getattr(inner, k.name) if k.init else None
        out += [t for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    return out


def _with_tensors(inner: Factors, tensors: Iterable[torch.Tensor]) -> Factors:
    """The inner factors with their tensors (in `_tensors_of` order) replaced by `tensors`."""
    it = iter(tensors)

    def swap(v: Any) -> Any:
        return next(it) if isinstance(v, torch.Tensor) else v

    values: dict[str, Any] = {}
    for k in (k for k in dataclasses.fields(inner) if k.init):
        v = getattr(inner, k.name)
        values[k.name] = tuple(map(swap, v)) if isinstance(v, tuple) else swap(v)
    return dataclasses.replace(inner, **values)


def _inner_path(
    f: DoraFactors, src: int, length: int, module: Any
) -> tuple[Callable[..., torch.Tensor], tuple[CastCache, ...], str]:
    """(path, caches, cost): path(x, conv) = ΔW x for rows [src, src+length), unscaled, on the inner family's
    runtime path; caches: what it reads (RuntimeTerm.caches)."""
    term = _INNER[f.kind].runtime_term(f.inner, src, 0, length)
    if term.fn is not None:
        return term.fn, term.caches, term.cost
    cache = CastCache(term.down, term.up)

    def path(x: torch.Tensor, conv: ConvSpec | None) -> torch.Tensor:
        down, up = cache.get(x)
        if conv is None:
            return F.linear(F.linear(x, down.flatten(1)), up)
        h = conv.fn(x, down.reshape(down.shape[0], *module.weight.shape[1:]), None, **conv.kwargs)
        return conv.fn(h, up.view(*up.shape, *([1] * (h.dim() - 2))))

    return path, (cache,), f"LoRA up(down(x)), rank {term.down.shape[0]}"


def runtime_term(f: DoraFactors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    """fn(x, conv, base_out, strength, scale): the DoRA change of rows [dst, dst+length) of module's output.

    The gain reads module.weight (the original: runtime never writes it) lazily, in row blocks."""
    if module is None:
        raise TypeError("DoRA runtime needs the host module: runtime_term(..., module=module)")
    refused = runtime_refusal(f, module)
    if refused is not None:
        raise PartRejected.of(refused)
    _whole(f, length)
    path, inner_caches, inner_cost = _inner_path(f, src, length, module)
    # Held (RuntimeTerm.caches), so a host counts and moves them: the inner path's tensors, the inner factors
    # and the magnitude (read when the gain is formed) and the gain itself, (a, a − 1, a·c) rewritten in place
    # when the strength changes.
    flat = _tensors_of(f.inner)
    mag = f.magnitude[src : src + length] if f.on_out else f.magnitude
    acc0 = torch.promote_types(torch.promote_types(mag.dtype, flat[0].dtype), torch.float32)
    inner_cache, mag_cache = CastCache(*flat), CastCache(mag)
    gain_cache = CastCache(torch.zeros(3, mag.numel(), dtype=acc0, device=mag.device))
    state: dict[str, tuple[float, float]] = {}

    def gains(strength: float, scale: float, like: torch.Tensor) -> torch.Tensor:
        """(3, n): a, a − 1, a·c, formed in fp32 (fp64 for fp64 weights) once per strength, cast to x's device
        and dtype."""
        s, c = _coeffs(f, strength, scale, strength * scale)
        if state.get("key") != (s, c):
            w = module.weight.detach()
            # float8 weights (ComfyUI's fp8 weight_dtype) do not promote: their norm runs in fp32
            low = w.element_size() == 1
            w2d, acc = (
                w.reshape(w.shape[0], -1),
                torch.float32 if low else torch.promote_types(w.dtype, torch.float32),
            )
            inner = _with_tensors(f.inner, inner_cache.to(w.device, acc))
            step, sums = max(1, BLOCK // w2d[0].numel()), []
            for r0 in range(0, length, step):  # W_c in row blocks: bounded temporary memory
                n = min(step, length - r0)
                wc = w2d[dst + r0 : dst + r0 + n].to(acc, copy=True)
                _INNER[f.kind].add_delta(wc, inner, src + r0, n, c)
                sums.append(_sumsq(f, wc))
            sumsq = torch.cat(sums) if f.on_out else torch.stack(sums).sum(0)
            a = _gain(f, sumsq, mag_cache.to(sumsq.device, sumsq.dtype)[0], s)
            (held,) = gain_cache.tensors
            held.copy_(torch.stack([a, a - 1, a * c]))
            gain_cache.refresh()
            state["key"] = (s, c)
        return gain_cache.to(like.device, like.dtype)[0]

    def fn(
        x: torch.Tensor, conv: ConvSpec | None, base_out: torch.Tensor, strength: float, scale: float
    ) -> torch.Tensor:
        shape = (-1,) if conv is None else (-1, *([1] * (x.dim() - 2)))  # channels last (Linear) or on dim 1
        am1: torch.Tensor
        ac: torch.Tensor
        _, am1, ac = (t.view(shape) for t in gains(strength, scale, x))
        if f.on_out:
            return base_out * am1 + path(x, conv) * ac
        # Input axis: W' − W = W·diag(a − 1) + c·ΔW·diag(a): scale x's channels before each path.
        w = module.weight[dst : dst + length].to(x.dtype)
        xm = x * am1
        return (F.linear(xm, w) if conv is None else conv.fn(xm, w, None, **conv.kwargs)) + path(x * ac, conv)

    cost = f"DoRA gain ({length if f.on_out else f.magnitude.numel()}) cached per strength + {inner_cost}"
    cost += "" if f.on_out else " + a GEMM with W (input axis)"
    caches = (*inner_caches, inner_cache, mag_cache, gain_cache)
    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        cost=cost,
        needs_base=True,
        linear_in_strength=False,
        caches=caches,
    )


SPEC = Family(
    "dora",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    settle=settle,
    check_piece=check_piece,
    runtime_refusal=runtime_refusal,
)
