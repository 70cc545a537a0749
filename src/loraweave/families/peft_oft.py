"""PEFT OFT (`<module>.oft_R.weight`, the packed form of PEFT >= 0.14): a block-diagonal rotation of the
INPUT.

Stored: `oft_R.weight` (r, b(b−1)/2), the strict upper triangle of each block's Q, row-major; Q = U − Uᵀ.
r = in·k / b blocks, or a single row shared by every block (`block_share`, detected from the shapes).
Rotation per block (PEFT 0.21 semantics, numerically checked against peft.tuners.oft):
- `use_cayley_neumann` (PEFT's default, 5 terms): the truncated series of (I + Q)(I − Q)⁻¹ that PEFT >= 0.18
  evaluates, R = I + 2Q + … + 2Q^(t−1) + Q^t with t = max(terms − 1, 3) for terms >= 3 (so 3 and 4 terms give
  the same R), R = I + 2Q for 2 terms and R = I for fewer. PEFT before 0.18 summed 2Q^k for k = 1 … terms − 1;
  an adapter_config.json of peft_type OFT without `peft_version` (field added in 0.18) or older than 0.18 gets
  that legacy series (PEFT 0.21 only warns and uses the new one, which changes such adapters).
- `use_cayley_neumann=False`: the exact R = (I − Q)(I + Q)⁻¹, the transpose of the series' target.
- `coft` (+ `eps`): each block's Q is scaled onto ‖Q‖_F = eps/√rows when it lies outside (rows = stored rows).
Merge: W' = W·blockdiag(R)ᵀ over the flattened (in, *k) columns of every output row (PEFT's merge_and_unload),
so the delta of each output row depends on that row alone and a fused key may be split over modules at any
row. Strength (PEFT OFT has no scale): R_s = I + s·(R − I), as our LyCORIS OFT's multiplier, so
ΔW = s·W·(blockdiag(R)ᵀ − I) is linear in s; s = 0 is the identity, s = −1 gives 2I − R (not R⁻¹).
Runtime: Δy = W_rows·(R_sᵀ − I)·x, the rotated-minus-original input through one extra GEMM with the layer's
live weight (Linear, and convolutions with a single kernel tap); a k×k convolution's rotation mixes kernel
taps with channels, so it runs as conv(x, ΔW) with ΔW cached. PEFT 0.21's own Conv2d forward (unfold, rotate,
fold) disagrees with its merge for k > 1, even at R = I (it sums overlapping patches): merge semantics are
used for both paths. Without an adapter config (a bare state dict) PEFT 0.21's defaults apply: Cayley-Neumann,
5 terms, no coft."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..report.miss import Miss
from .base import CastCache, ConvSpec, Family, PartRejected, RuntimeTerm, check_factor, refuse_roles
from .oft_common import acc_dtype

DEFAULTS: dict[str, Any] = {
    "use_cayley_neumann": True,
    "num_cayley_neumann_terms": 5,
    "coft": False,
    "eps": 6e-5,
}  # PEFT 0.21
_OFT_FIELDS = ("oft_block_size", "use_cayley_neumann", "num_cayley_neumann_terms", "coft", "block_share")


@dataclass
class PeftOftFactors:
    vec: torch.Tensor  # (stored rows, b(b−1)/2), stored dtype
    block: int  # b
    neumann_terms: int | None  # None: exact Cayley
    legacy_series: bool  # PEFT < 0.18 Cayley-Neumann coefficients
    coft_eps: float | None  # None: no projection
    block_share: bool | None  # from the config; None: unknown (the shapes decide)
    form: str  # how R is built and where that came from, for reports
    _minus_i: dict[tuple[torch.device, torch.dtype], torch.Tensor] = field(
        default_factory=dict
    )  # (device, dtype) -> R − I (stored rows, b, b)

    @property
    def rows(self) -> None:
        return None  # the rotation acts on the input: any number of output rows

    @property
    def shared(self) -> bool:
        return self.vec.shape[0] == 1


def _field(config: Mapping[str, Any], name: str) -> Any:  # a JSON value of the config
    """A config field, plain or prefixed by a component (diffusers' `transformer.use_cayley_neumann`)."""
    if name in config:
        return config[name]
    found = {repr(v): v for k, v in config.items() if isinstance(k, str) and k.endswith("." + name)}
    if len(found) > 1:
        raise PartRejected(
            "ambiguous", f"ambiguous PEFT OFT config: components disagree on {name} ({', '.join(found)})"
        )
    return next(iter(found.values()), None)


def _version_below(version: object, major: int, minor: int) -> bool:
    m = re.match(r"\s*(\d+)\.(\d+)", str(version or ""))
    return m is None or (int(m[1]), int(m[2])) < (major, minor)


def _not_oft(config: Mapping[str, Any] | None, peft_type: object) -> str | None:
    """Why `config` does not describe a PEFT OFT adapter (PEFT's defaults then apply), or None if it does."""
    if config is None:
        return "no adapter config"
    if str(peft_type).upper() == "OFT":
        return None
    if peft_type is None and any(_field(config, n) is not None for n in _OFT_FIELDS):
        return None
    return f"adapter config is {peft_type}, not OFT" if peft_type else "adapter config has no OFT fields"


def _settings(config: Mapping[str, Any] | None) -> tuple[int | None, bool, float | None, bool | None, str]:
    """(Neumann terms or None, legacy series, coft eps or None, block_share, source) from an adapter
    config."""
    peft_type = None if config is None else _field(config, "peft_type")
    why = _not_oft(config, peft_type)
    if why is not None:
        return DEFAULTS["num_cayley_neumann_terms"], False, None, None, f"PEFT 0.21 defaults ({why})"
    assert config is not None  # _not_oft names a missing config

    def get(name: str) -> Any:
        value = _field(config, name)
        return DEFAULTS[name] if value is None else value

    if str(peft_type).upper() == "OFT" and _field(config, "oft_block_size") is None:
        raise PartRejected(
            "unsupported", "unsupported family: PEFT OFT from before PEFT 0.14 (config has no oft_block_size)"
        )
    try:
        neumann, terms, coft, eps = (
            bool(get("use_cayley_neumann")),
            int(get("num_cayley_neumann_terms")),
            bool(get("coft")),
            float(get("eps")),
        )
    except (TypeError, ValueError) as exc:
        raise PartRejected(
            "bad_tensor", f"bad tensor: PEFT OFT config field is not a number ({exc})"
        ) from None
    if coft and not math.isfinite(eps):
        raise PartRejected("non_finite", "bad tensor: PEFT OFT config eps is not finite")
    share = _field(config, "block_share")
    version = _field(config, "peft_version")
    legacy = neumann and str(peft_type).upper() == "OFT" and _version_below(version, 0, 18)
    return (
        (terms if neumann else None),
        legacy,
        (eps if coft else None),
        (None if share is None else bool(share)),
        (f"adapter config (peft_version {version or 'missing: < 0.18'})"),
    )


def load(
    tensors: dict[str, torch.Tensor], key_of: dict[str, str], config: dict[str, Any] | None = None
) -> PeftOftFactors:
    refuse_roles("PEFT OFT", set(tensors) - {"oft_R"}, key_of)
    vec = tensors["oft_R"]
    check_factor(key_of["oft_R"], vec)
    n = vec.shape[1] if vec.dim() == 2 else -1
    root = math.isqrt(8 * n + 1) if n >= 0 else 0
    if vec.dim() != 2 or vec.shape[0] == 0 or root * root != 8 * n + 1:
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: {key_of['oft_R']} {tuple(vec.shape)} is not (blocks, b(b−1)/2)",
        )
    block = (root + 1) // 2
    terms, legacy, eps, share, source = _settings(config)
    if share and vec.shape[0] != 1:
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: {key_of['oft_R']} {tuple(vec.shape)} has several rows but the config "
            "says block_share (PEFT then stores one)",
        )
    kind = (
        "exact Cayley"
        if terms is None
        else f"Cayley-Neumann, {terms} terms" + (" (PEFT < 0.18 series)" if legacy else "")
    )
    form = f"{kind}{f', coft eps {eps:g}' if eps is not None else ''}; {source}"
    return PeftOftFactors(vec, block, terms, legacy, eps, share, form)


def _blocks(f: PeftOftFactors, cols: int) -> int:
    return cols // f.block


def check_target(f: PeftOftFactors, shape: tuple[int, ...]) -> Miss | None:
    cols = math.prod(shape[1:]) if len(shape) > 1 else 0
    stored, b = f.vec.shape[0], f.block
    if stored * b == cols or (f.shared and f.block_share is not False and cols and cols % b == 0):
        return None
    shared = f" (or a multiple of {b}, shared)" if f.shared else ""
    return Miss(
        "shape_mismatch",
        f"shape mismatch: PEFT OFT rotates {stored * b}{shared} input columns, module {tuple(shape)} has "
        f"{cols}",
    )


def check_piece(f: PeftOftFactors, src: int, length: int) -> Miss | None:
    return None  # each output row's delta reads only that row of W: any row slice lands on its own


def _series(q: torch.Tensor, f: PeftOftFactors) -> torch.Tensor:
    """R − I = Σ c_k Q^k for PEFT's truncated Cayley-Neumann series (see the module docstring)."""
    terms = f.neumann_terms
    assert terms is not None  # the series form only (None: exact Cayley)
    if terms <= 1:
        return torch.zeros_like(q)
    if terms == 2:
        coeffs = [2.0]
    elif f.legacy_series:
        coeffs = [2.0] * (terms - 1)
    else:
        top = max(terms - 1, 3)
        coeffs = [2.0] * (top - 1) + [1.0]
    out, power = torch.zeros_like(q), q
    for i, c in enumerate(coeffs):
        if i:
            power = power @ q
        out = out + c * power
    return out


def rotation_minus_i(f: PeftOftFactors, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """R − I per stored block, (stored rows, b, b), built once per (device, dtype) in fp32 (fp64 stays
    fp64)."""
    key = (device, dtype)
    if key not in f._minus_i:
        acc = torch.promote_types(acc_dtype(f.vec), dtype)
        rows, b = f.vec.shape[0], f.block
        iu = torch.triu_indices(b, b, 1)
        q = torch.zeros(rows, b, b, dtype=acc)
        q[:, iu[0], iu[1]] = f.vec.detach().to("cpu", acc)
        q = q - q.mT
        if f.coft_eps is not None:
            bound = f.coft_eps / math.sqrt(rows)
            norm = torch.linalg.matrix_norm(q, keepdim=True)
            q = torch.where((norm <= bound) | (norm == 0), q, q * (bound / norm.clamp_min(1e-300)))
        if f.neumann_terms is None:  # (I − Q)(I + Q)⁻¹ − I = −2Q(I + Q)⁻¹
            eye = torch.eye(b, dtype=acc)
            d = torch.linalg.solve(eye + q, -2 * q, left=False)
        else:
            d = _series(q, f)
        f._minus_i = {**f._minus_i, key: d.to(device, dtype)}
    return f._minus_i[key]


def _blockwise(d: torch.Tensor, t: torch.Tensor, pattern: str) -> torch.Tensor:
    """Apply the per-block D along t's last axis (blocks of b), expanding a shared block to every block."""
    b = d.shape[-1]
    tb = t.unflatten(-1, (-1, b))  # type: ignore[no-untyped-call]  # torch leaves unflatten unannotated
    if d.shape[0] != tb.shape[-2]:
        d = d.expand(tb.shape[-2], b, b)
    return torch.einsum(pattern, tb, d).flatten(-2)


def delta_rows(f: PeftOftFactors, w: torch.Tensor) -> torch.Tensor:
    """(rows, cols): W·blockdiag(R)ᵀ − W for rows of W flattened to (rows, in·k), s = 1."""
    d = rotation_minus_i(f, w.device, w.dtype)
    return _blockwise(d, w, "okn,kmn->okm")


def add_delta(
    target_rows: torch.Tensor,
    f: PeftOftFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor,
    **_: object,
) -> None:
    """target_rows (length, in·k) += s·W·(blockdiag(R)ᵀ − I) for the original rows `base`, s = coeff."""
    target_rows.add_(delta_rows(f, base.to(target_rows.dtype).flatten(1)), alpha=coeff)


def bias_delta(f: PeftOftFactors, src: int, length: int) -> None:
    return None  # PEFT rotates the input: the bias is untouched


def _plain_weight(module: torch.nn.Module | None) -> str | None:
    weight = getattr(module, "weight", None)
    if module is None or weight is None:
        return "needs the host module's weight"
    if type(weight) not in (torch.Tensor, torch.nn.Parameter) or not weight.is_floating_point():
        return f"needs a plain floating weight, the module holds a {type(weight).__name__} of {weight.dtype}"
    if weight.device.type == "meta":
        return "needs the weight, which is offloaded (meta device)"
    return None


def runtime_refusal(f: PeftOftFactors, module: Any) -> Miss | None:  # the host or its dequantized view
    why = _plain_weight(module)
    return Miss("unsupported", f"unsupported family: PEFT OFT at runtime {why}") if why else None


def runtime_term(f: PeftOftFactors, src: int, dst: int, length: int, module: Any = None) -> RuntimeTerm:
    """Δy = W_rows·(R_sᵀ − I)·x at s = 1 (the runtime scales it by the strength: ΔW is linear in s)."""
    refused = runtime_refusal(f, module)
    if refused is not None:
        raise PartRejected.of(refused)
    taps = math.prod(module.weight.shape[2:])
    cache: dict[tuple[object, ...], torch.Tensor] = {}
    # R − I built once in fp64 (small) and held (RuntimeTerm.caches); the k×k conv form keeps a dense ΔW
    # rebuilt when W changes instead (declared `unheld`)
    held = CastCache(rotation_minus_i(f, f.vec.device, torch.float64).clone())

    def fn(x: torch.Tensor, conv: ConvSpec | None) -> torch.Tensor:
        weight: torch.Tensor = module.weight
        rows = weight.detach()[dst : dst + length]
        acc = torch.promote_types(x.dtype, torch.float32)
        if conv is not None and taps > 1:  # kernel taps mixed with channels: dense ΔW, rebuilt if W changes
            key = (x.device, x.dtype, weight.data_ptr(), weight._version)
            if key not in cache:
                flat = rows.to(x.device, acc).flatten(1)
                cache.clear()
                cache[key] = delta_rows(f, flat).view_as(rows).to(x.dtype)
            return conv.fn(x, cache[key], None, **conv.kwargs)
        (d,) = held.to(x.device, acc)
        moved = x if conv is None else x.movedim(1, -1)
        dx = _blockwise(d, moved.to(acc), "...kj,kjc->...kc")
        if conv is None:
            return F.linear(dx.to(rows.dtype), rows).to(x.dtype)
        return conv.fn(dx.movedim(-1, 1).to(rows.dtype), rows, None, **conv.kwargs).to(x.dtype)

    cols = math.prod(module.weight.shape[1:])
    blocks = f"{_blocks(f, cols)}x{f.block}{' shared' if f.shared else ''}"
    how = (
        "dense ΔW cached (k×k conv)"
        if taps > 1
        else f"input rotation ({blocks} blocks) + one extra base GEMM"
    )
    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        needs_base=False,
        linear_in_strength=True,
        cost=f"PEFT OFT {how}; R: {f.form}",
        **({"unheld": "PEFT OFT k×k conv: dense ΔW per weight version"} if taps > 1 else {"caches": (held,)}),
    )


# An "oft" part holding oft_R; alpha is not a scale, the PEFT config sets the form.
SPEC = Family(
    "peft_oft",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    load_with_config=load,
    uses_alpha_scale=False,
    check_piece=check_piece,
    runtime_refusal=runtime_refusal,
)
