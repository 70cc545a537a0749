"""IA3: per-channel scaling of the original weight. No alpha; the delta reads W (NEEDS_BASE).

LyCORIS: `weight` (out,) / conv (1, out, 1..), or (in,) / (1, in, 1..) when the `on_input` flag is 1:
W' = W ⊙ (1 + s·w) along output rows (input columns). The bias is not scaled (LyCORIS merge; its bypass
forward scales it too, which merge and runtime here do not follow).
PEFT `ia3_l`: (out, 1) or (1, in) for Linear, (1, n, 1..) for conv (input or output told apart by the module's
shape; a square conv is ambiguous and refused). PEFT computes W' = W ⊙ l, and on the output side also b' = b ⊙
l. Strength: l_s = 1 + s·(l − 1), i.e. the LyCORIS rule with w = l − 1: exact PEFT at s = 1, identity at s =
0, linear in s (so runtime = merge). PEFT's bias scaling needs the original bias: bias_delta(...,
base=b_rows). Runtime: output side y += s·w ⊙ (W·x) from the base output; input side y += s·W·(x ⊙ w), one
extra product by the layer's own weight (an input pre-hook would be cheaper; the runtime has none)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factor, is_channel_vector
from .glora import layer_product


@dataclass
class Ia3Factors:
    w: torch.Tensor  # (n,) flat, stored dtype: LyCORIS `weight` or PEFT `ia3_l`
    peft: bool  # effective vector is l − 1; output side scales the bias too
    on_input: bool | None  # None: decided by check_target from the module's shape
    ambiguous_ok: bool = (
        False  # values unknown (meta planning): an undecidable square layer is planned as output
    )
    rank: None = None
    is_conv_kernel: bool = False

    @property
    def rows(self) -> int | None:
        return None if self.on_input else self.w.numel()  # the input side spans every output row


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> Ia3Factors:
    if "ia3_l" in tensors:
        return _load_peft(tensors, key_of)
    return _load_lycoris(tensors, key_of)


def _load_peft(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> Ia3Factors:
    if "weight" in tensors or "on_input" in tensors:
        raise PartRejected("bad_tensor", "bad part: PEFT ia3_l mixed with LyCORIS weight/on_input")
    t = tensors["ia3_l"]
    check_factor(key_of["ia3_l"], t)
    if t.dim() == 2 and 1 in t.shape:
        on_input = t.shape[0] == 1 and t.shape[1] != 1  # (out, 1): output; (1, in): input
    elif is_channel_vector(t):
        on_input = None  # conv (1, n, 1..): PEFT uses one layout for both sides
    else:
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: ia3_l {tuple(t.shape)} is not (out, 1), (1, in) or (1, n, 1..)",
        )
    return Ia3Factors(t.flatten(), True, on_input, t.device.type == "meta")


def _load_lycoris(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> Ia3Factors:
    if "weight" not in tensors or "on_input" not in tensors:
        raise PartRejected(
            "incomplete", f"incomplete IA3: no {'weight' if 'weight' not in tensors else 'on_input'} tensor"
        )
    w, flag = tensors["weight"], tensors["on_input"]
    check_factor(key_of["weight"], w)
    if flag.numel() != 1:
        raise PartRejected(
            "bad_tensor",
            f"bad tensor: {key_of['on_input']} should be a scalar, has shape {tuple(flag.shape)}",
        )
    if not (w.dim() == 1 or is_channel_vector(w)):
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: IA3 weight {tuple(w.shape)} is not (n,) or (1, n, 1..)"
        )
    meta = flag.device.type == "meta"
    return Ia3Factors(w.flatten(), False, None if meta else bool(flag.reshape(()).item()), meta)


def check_target(f: Ia3Factors, shape: tuple[int, ...]) -> Miss | None:
    if len(shape) < 2:
        return Miss(
            "shape_mismatch", f"shape mismatch: IA3 needs a Linear or Conv weight, module weight is {shape}"
        )
    n, fits_in, fits_out = f.w.numel(), f.w.numel() == shape[1], f.w.numel() == shape[0]
    if f.on_input is None:
        if fits_in and fits_out and not f.ambiguous_ok:
            return Miss(
                "ambiguous",
                f"ambiguous: IA3 vector of {n} on a square {shape} layer, input or output side unknown "
                "(PEFT conv ia3_l)",
            )
    on_input = f.on_input if f.on_input is not None else fits_in and not fits_out
    if on_input and not fits_in:
        return Miss("shape_mismatch", f"shape mismatch: IA3 input vector of {n} vs module input {shape[1]}")
    return None


def settle(f: Ia3Factors, shape: tuple[int, ...]) -> Ia3Factors:
    """A PEFT conv vector names no side: the module's shape decides (a square layer stays undecided)."""
    if f.on_input is not None or len(shape) < 2:
        return f
    fits_in, fits_out = f.w.numel() == shape[1], f.w.numel() == shape[0]
    if fits_in and fits_out and not f.ambiguous_ok:
        return f
    return dataclasses.replace(f, on_input=fits_in and not fits_out)


def _vector(f: Ia3Factors, dtype: torch.dtype) -> torch.Tensor:
    w = f.w.to(dtype)
    return w - 1 if f.peft else w


def add_delta(
    target_rows: torch.Tensor,
    f: Ia3Factors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor | None = None,
    **_: object,
) -> None:
    """target_rows (length, in*k) += coeff · W_rows ⊙ w (w along rows, or along input channels)."""
    if base is None:
        raise ValueError("IA3 scales the original weight: add_delta needs base=")
    w = _vector(f, target_rows.dtype)
    if f.on_input:
        scale = w.repeat_interleave(target_rows.shape[1] // w.numel())[None, :]
    else:
        scale = w[src : src + length, None]
    target_rows.addcmul_(base, scale, value=coeff)


def bias_delta(f: Ia3Factors, src: int, length: int, base: torch.Tensor | None = None) -> torch.Tensor | None:
    """PEFT output side: (l − 1) ⊙ b_rows, given the original bias rows; nothing otherwise."""
    if not f.peft or f.on_input or base is None:
        return None
    return _vector(f, base.dtype)[src : src + length] * base


def runtime_term(f: Ia3Factors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    acc = torch.float64 if f.w.dtype == torch.float64 else torch.float32
    w = _vector(f, acc)
    if not f.on_input:
        rows = w[src : src + length]
        bias = None
        if f.peft:
            if module is None:
                raise RuntimeError("PEFT IA3 scales the bias: runtime_term needs the host module (module=)")
            b = getattr(module, "bias", None)
            bias = rows * b.detach()[dst : dst + length].to(acc) if isinstance(b, torch.Tensor) else None
        out_cache = CastCache(rows)

        def scale_out(x: torch.Tensor, conv: ConvSpec | None, base_out: torch.Tensor) -> torch.Tensor:
            (v,) = out_cache.get(base_out)
            return base_out * (v.view(-1, *[1] * (base_out.dim() - 2)) if conv is not None else v)

        return RuntimeTerm.structured(
            dst,
            length,
            bias,
            fn=scale_out,
            cost="IA3 output scale",
            needs_base=True,
            caches=(out_cache,),
        )
    if module is None:
        raise RuntimeError("IA3 on the input reads W: runtime_term needs the host module (module=)")
    in_cache = CastCache(w)

    def scale_in(x: torch.Tensor, conv: ConvSpec | None) -> torch.Tensor:
        (v,) = in_cache.get(x)
        return layer_product(
            module, x * (v.view(-1, *[1] * (x.dim() - 2)) if conv is not None else v), conv, dst, length
        )

    return RuntimeTerm.structured(
        dst,
        length,
        fn=scale_in,
        cost="IA3 input scale: one extra W product",
        caches=(in_cache,),
    )


SPEC = Family(
    "ia3",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta_from_base=bias_delta,
    host_runtime_term=runtime_term,
    uses_alpha_scale=False,
    settle=settle,
)
