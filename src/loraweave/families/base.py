"""What every family provides: load + validate factors, add its delta, give its runtime terms.

Each family module declares one `Family` (below) named SPEC: its functions and abilities, every ability with a
default, so nothing is discovered by probing attributes or signatures. Every family contributes ΔW_i computed
from the ORIGINAL weight; contributions on one layer are summed (the rule a1111/LyCORIS loaders use when
several networks touch one layer), so order never matters."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ..report.miss import Miss


class PartRejected(Exception):
    """A part cannot be applied; `.miss` (kind + readable reason) goes into the report."""

    def __init__(self, kind: str, detail: str) -> None:
        self.miss = Miss(kind, detail)
        super().__init__(detail)

    @classmethod
    def of(cls, miss: Miss) -> PartRejected:
        return cls(miss.kind, miss.detail)


_CASTS = threading.local()


class CastMemo:
    """While entered on this thread, `cast_once` casts each factor tensor once per dtype into this memo: a
    merge computes ΔW block by block of rows from the same factors, and would otherwise cast them for every
    block. The casts hold the same values (fp16/bf16 to fp32 is exact), so a record that recomputes ΔW gets
    the same bits. Entered again for each block; the casts live as long as the memo."""

    def __init__(self) -> None:
        self.casts: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self._outer: list[dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None] = []

    def __enter__(self) -> CastMemo:
        self._outer.append(getattr(_CASTS, "memo", None))
        _CASTS.memo = self.casts
        return self

    def __exit__(self, *exc: object) -> None:
        _CASTS.memo = self._outer.pop()


def cast_once(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t.to(dtype), kept while a `CastMemo` is entered (the source is held with it, so its id stays
    unique)."""
    memo: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None = getattr(
        _CASTS, "memo", None
    )
    if memo is None or t.dtype == dtype:
        return t.to(dtype)
    hit = memo.get((id(t), dtype))
    if hit is None:
        hit = memo[(id(t), dtype)] = (t, t.to(dtype, memory_format=torch.contiguous_format))
    return hit[1]


Factors = Any  # each family's own factors record (LoraFactors, OftFactors, ...)
Shape = tuple[int, ...]


class Loader(Protocol):
    """Validate one part's tensors (role -> tensor; role -> file key for messages) into factors."""

    def __call__(self, tensors: dict[str, torch.Tensor], key_of: dict[str, str], /) -> Factors: ...


class ConfiguredLoader(Protocol):
    """A Loader that also reads the adapter's PEFT config fields (None: PEFT's defaults)."""

    def __call__(
        self, tensors: dict[str, torch.Tensor], key_of: dict[str, str], config: dict[str, Any] | None, /
    ) -> Factors: ...


class TargetCheck(Protocol):
    def __call__(self, f: Factors, shape: Shape, /) -> Miss | None: ...


class Settle(Protocol):
    def __call__(self, f: Factors, shape: Shape, /) -> Factors: ...


class PieceCheck(Protocol):
    def __call__(self, f: Factors, src: int, length: int, /) -> Miss | None: ...


class DeltaAdder(Protocol):
    """target_rows += coeff·ΔW for rows [src, src+length), from the factors alone."""

    def __call__(
        self, target_rows: torch.Tensor, f: Factors, src: int, length: int, coeff: float, /
    ) -> None: ...


class BaseDeltaAdder(Protocol):
    """target_rows += ΔW from the ORIGINAL rows `base`, at `strength` and `scale` (ΔW may not be linear in
    them; coeff = strength·scale)."""

    def __call__(
        self,
        target_rows: torch.Tensor,
        f: Factors,
        src: int,
        length: int,
        coeff: float,
        /,
        *,
        base: torch.Tensor,
        strength: float,
        scale: float,
    ) -> None: ...


class BiasDelta(Protocol):
    """The unscaled bias delta of rows [src, src+length), or None."""

    def __call__(self, f: Factors, src: int, length: int, /) -> torch.Tensor | None: ...


class BaseBiasDelta(Protocol):
    """A BiasDelta read from the layer's original bias rows `base` (None: the layer has no bias)."""

    def __call__(
        self, f: Factors, src: int, length: int, /, *, base: torch.Tensor | None = None
    ) -> torch.Tensor | None: ...


class RuntimeTermFn(Protocol):
    def __call__(self, f: Factors, src: int, dst: int, length: int, /) -> RuntimeTerm: ...


class HostRuntimeTermFn(Protocol):
    """A runtime term that reads the host layer (its weight, its kind): the module or a dequantized view."""

    def __call__(self, f: Factors, src: int, dst: int, length: int, /, *, module: Any) -> RuntimeTerm: ...


class RuntimeRefusal(Protocol):
    """Whether the runtime term will refuse this host (None: the family does not read it)."""

    def __call__(self, f: Factors, module: Any, /) -> Miss | None: ...


class InputWidth(Protocol):
    def __call__(self, f: Factors, /) -> int | None: ...


class WidenInput(Protocol):
    def __call__(self, f: Factors, shape: Shape, /) -> Factors | None: ...


class TakeColumns(Protocol):
    """The factors of ΔW's input columns [start, start+width) alone (`bias`: keep the output bias term, which
    one column piece of a split layer carries); None when the family's ΔW does not split by columns."""

    def __call__(self, f: Factors, start: int, width: int, bias: bool, /) -> Factors | None: ...


class GatherRows(Protocol):
    """The factors of ΔW's rows in the order `index` lists them (row n of the result is row index[n]); None
    when the family's rows do not reorder on their own."""

    def __call__(self, f: Factors, index: torch.Tensor, /) -> Factors | None: ...


class DeltaBound(Protocol):
    def __call__(self, f: Factors, src: int, length: int, /) -> float | None: ...


class SquaredNorm(Protocol):
    def __call__(self, f: Factors, src: int, length: int, /) -> float | None: ...


def _same(f: Factors, shape: Shape) -> Factors:
    return f


def _any_piece(f: Factors, src: int, length: int) -> None:
    return None


def _no_width(f: Factors) -> None:
    return None


def _no_widening(f: Factors, shape: Shape) -> None:
    return None


def _no_columns(f: Factors, start: int, width: int, bias: bool) -> None:
    return None


def _no_gather(f: Factors, index: torch.Tensor) -> None:
    return None


def _runtime_ok(f: Factors, module: Any) -> None:
    return None


def _unbounded(f: Factors, src: int, length: int) -> None:
    return None


def _no_bias(f: Factors, src: int, length: int) -> None:
    return None


def _no_norm(f: Factors, src: int, length: int) -> None:
    return None


@dataclass(eq=False)
class Family:
    """One adapter family: its functions and what it can do. Defaults describe a plain low-rank family.

    Where families differ in what a function reads, each kind has its own typed field:
    - load(tensors, key_of) -> factors: validate one part's tensors (role -> tensor) with PEFT's defaults;
      a family that also reads the adapter's PEFT config fields gives `load_with_config` too (used when set).
    - add_delta(target_rows, f, src, length, coeff): ΔW from the factors alone; `add_delta_from_base` instead
      for families whose ΔW reads the ORIGINAL rows (`base=`) and the strength and scale (they may not be
      linear in them): `needs_base`; runtime terms of those get the layer's output without bias.
      bias_delta(f, src, length), or `bias_delta_from_base` (base= the original bias rows).
    - runtime_term(f, src, dst, length), or `host_runtime_term(..., module=)` for families that read the host
      module (`reads_host`); runtime_refusal(f, module) -> Miss | None says beforehand whether they will
      refuse it.
    - settle(f, shape) -> f: the factors fixed on a module shape (kernel, IA3 side, GLoRA naming); a new
      object, `f` itself untouched. check_target(f, shape) -> Miss | None judges settled factors and changes
      nothing.
    - check_piece(f, src, length) -> Miss | None: whether rows [src, src+length) land on their own (fused
      keys).
    - roles: every role a part may hold (None: load checks); uses_alpha_scale=False: alpha is not alpha/rank
      (the raw `alpha` tensor goes to load). input_width(f) / widen_input(f, shape): control-adapter growth.
      take_columns(f, start, width, bias): ΔW's input columns alone (a runtime's column-split layer);
      gather_rows(f, index): ΔW's rows reordered (a runtime's interleaved layer).
    - delta_bound(f, src, length) -> float | None: an upper bound on max |ΔW| (coeff 1) over rows
      [src, src+length), inf/nan for non-finite factors; None where the family declares none. A merge whose
      bound leaves no room to overflow skips its finite check and, with undo="none", its record.
    - squared_norm(f, src, length) -> float | None: ‖ΔW rows [src, src+length)‖² (coeff 1) from the factors,
      with ΔW never formed; None where the family declares none (a caller then forms ΔW).
    - set_delta(target_rows, f, src, length, coeff) or None: target_rows = coeff·ΔW, written, not added (the
      same bits as add_delta into zeros, with no zero pass and no read of the block).
    - fused_add(target_rows, f, src, length, coeff) or None: target_rows += coeff·ΔW in one pass, ΔW never
      stored, with set_delta's bits then one add where the BLAS rounds its product before adding it
      (mechanisms/merge/delta.blas_rounds_product); undo="none" writes fp32 weights with it."""

    name: str
    load: Loader
    check_target: TargetCheck
    add_delta: DeltaAdder | None = None
    bias_delta: BiasDelta = _no_bias
    runtime_term: RuntimeTermFn | None = None
    roles: tuple[str, ...] | None = None
    uses_alpha_scale: bool = True
    load_with_config: ConfiguredLoader | None = None
    add_delta_from_base: BaseDeltaAdder | None = None
    bias_delta_from_base: BaseBiasDelta | None = None
    host_runtime_term: HostRuntimeTermFn | None = None
    settle: Settle = _same
    check_piece: PieceCheck = _any_piece
    input_width: InputWidth = _no_width
    widen_input: WidenInput = _no_widening
    take_columns: TakeColumns = _no_columns
    gather_rows: GatherRows = _no_gather
    runtime_refusal: RuntimeRefusal = _runtime_ok
    delta_bound: DeltaBound = _unbounded
    set_delta: DeltaAdder | None = None
    fused_add: DeltaAdder | None = None
    squared_norm: SquaredNorm = _no_norm

    def __post_init__(self) -> None:
        for kinds in (("add_delta", "add_delta_from_base"), ("runtime_term", "host_runtime_term")):
            if sum(getattr(self, k) is not None for k in kinds) != 1:
                raise TypeError(f"family {self.name}: give exactly one of {' / '.join(kinds)}")

    @property
    def needs_base(self) -> bool:
        """ΔW reads the original weight rows (and may not be linear in strength)."""
        return self.add_delta_from_base is not None

    @property
    def bias_needs_base(self) -> bool:
        return self.bias_delta_from_base is not None

    @property
    def reads_host(self) -> bool:
        """The runtime term reads the host module (a quantized one is seen dequantized)."""
        return self.host_runtime_term is not None

    def load_part(
        self, tensors: dict[str, torch.Tensor], key_of: dict[str, str], config: dict[str, Any] | None
    ) -> Factors:
        if self.load_with_config is not None:
            return self.load_with_config(tensors, key_of, config)
        return self.load(tensors, key_of)

    def fit(self, f: Factors, shape: Shape) -> tuple[Factors, Miss | None]:
        """(factors settled on `shape`, Miss or None)."""
        settled = self.settle(f, shape)
        return settled, self.check_target(settled, shape)

    def add(
        self,
        target_rows: torch.Tensor,
        f: Factors,
        src: int,
        length: int,
        coeff: float,
        base: torch.Tensor | None = None,
        strength: float = 1.0,
        scale: float = 1.0,
    ) -> None:
        """target_rows += coeff·ΔW; `base`: the original rows, read with strength and scale by needs_base
        families."""
        if self.add_delta_from_base is not None:
            if base is None:
                raise PartRejected("unsupported", f"unsupported: {self.name} needs the layer's float weight")
            self.add_delta_from_base(
                target_rows, f, src, length, coeff, base=base, strength=strength, scale=scale
            )
        else:
            assert self.add_delta is not None  # __post_init__: exactly one
            self.add_delta(target_rows, f, src, length, coeff)

    def bias(self, f: Factors, src: int, length: int, base: torch.Tensor | None) -> torch.Tensor | None:
        """The unscaled bias delta; `base`: the original bias rows, read by bias_needs_base families."""
        if self.bias_delta_from_base is not None:
            return self.bias_delta_from_base(f, src, length, base=base)
        return self.bias_delta(f, src, length)

    def term(self, f: Factors, src: int, dst: int, length: int, module: Any) -> RuntimeTerm:
        if self.host_runtime_term is not None:
            return self.host_runtime_term(f, src, dst, length, module=module)
        assert self.runtime_term is not None  # __post_init__: exactly one
        return self.runtime_term(f, src, dst, length)


@dataclass
class RuntimeTerm:
    """One contribution to a layer's runtime path: y[rows] += coeff · (up_rows @ down(x) | dense(x) | fn(x)).

    Exactly one of (down, up), dense or fn is set, plus an optional bias. `fn(x, conv)` returns the unscaled
    delta output for input x, rows [dst_start, dst_start+length); `conv` holds the layer's conv function and
    its stride/padding/dilation (None for Linear). fn casts its own tensors to x's device and dtype."""

    down: torch.Tensor | None  # (r, in, *k): LoRA down with any Tucker core folded in
    up: torch.Tensor | None  # (length, r)
    dense: torch.Tensor | None  # (length, in, *k) for full diffs
    bias: torch.Tensor | None  # (length,)
    dst_start: int
    length: int
    fn: Callable[..., torch.Tensor] | None = None
    cost: str = ""  # what the runtime form costs, for the report ("dense ΔW cached", ...)
    needs_base: bool = False  # fn takes a third argument: the base output without bias
    # False: fn(x, conv, base_out, strength, scale) applies the live strength itself (OFT, DoRA) and the
    # runtime does not multiply its result by strength·scale.
    linear_in_strength: bool = True
    # Every tensor fn reads (beyond the host layer's own and its input) comes through one of these caches: a
    # host that counts and moves the adapter's memory (ComfyUI's model management) holds their sources and
    # re-points them after a move (CastCache.repoint). A term with fn declares its caches, or says in `unheld`
    # what it keeps that no host can hold (RuntimePath refuses a term that does neither).
    caches: tuple[CastCache, ...] = ()
    unheld: str = ""

    @classmethod
    def structured(
        cls, dst: int, length: int, bias: torch.Tensor | None = None, **fields: Any
    ) -> RuntimeTerm:
        """A term computed by `fn` (in `fields`, with its caches, cost, ...): no low-rank pair, no dense
        diff."""
        return cls(None, None, None, bias, dst, length, **fields)


@dataclass(frozen=True)
class ConvSpec:
    """How the host layer convolves: the function (F.conv1d/2d/3d) and its keyword arguments."""

    fn: Callable[..., torch.Tensor]
    kwargs: dict[str, Any]


class CastCache:
    """Tensors cast once per (device, dtype) for the runtime path; strength changes never rebuild them."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors
        self._key: tuple[torch.device, torch.dtype] | None = None
        self._cast: tuple[torch.Tensor, ...] = ()

    def get(self, like: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.to(like.device, like.dtype)

    def put(self, device: torch.device, dtype: torch.dtype, cast: tuple[torch.Tensor, ...]) -> None:
        """Use `cast` (tensors someone else owns, e.g. a streaming slot's views) as the (device, dtype)
        copy."""
        self._key, self._cast = (device, dtype), tuple(cast)

    def clear(self) -> None:
        self._key, self._cast = None, ()

    def repoint(self, tensors: tuple[torch.Tensor, ...]) -> None:
        """Read from `tensors` from now on (the same values, moved by their holder); any cast is dropped."""
        if len(tensors) != len(self.tensors):
            raise ValueError(f"repoint: {len(tensors)} tensors for a cache of {len(self.tensors)}")
        self.tensors = tuple(tensors)
        self.clear()

    def to(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        # A host may also move a source in place (Module.to sets .data): a cast that is that object is then
        # stale.
        if (device, dtype) != self._key or any(c.device != device or c.dtype != dtype for c in self._cast):
            self._cast = tuple(t.to(device, dtype, non_blocking=_staged(t, device)) for t in self.tensors)
            self._key = (device, dtype)
        return self._cast

    def refresh(self) -> None:
        """The source tensors changed in place (a strength change): write them into the existing cast, ordered
        on the current stream after the kernels still reading it, without allocating or synchronizing."""
        if not self._cast:
            return  # nothing cast yet: the next forward casts the current values
        for cast, t in zip(self._cast, self.tensors, strict=True):
            if cast is not t:
                cast.copy_(t, non_blocking=_staged(t, cast.device))


def _staged(t: torch.Tensor, device: torch.device) -> bool:
    """A copy from pageable host memory to an accelerator can be issued without waiting: the driver stages the
    source at once, so it may change right after (a pinned source is read later: wait; a copy towards the host
    must block, its values are read right after)."""
    return device.type not in ("cpu", "meta") and t.device.type == "cpu" and not t.is_pinned()


class KnownFinite:
    """While entered on this thread, `check_factor` takes these tensor objects as finite without a pass of its
    own: their source proved them finite in bulk (io.safetensors_file.SafetensorsFile.finite_keys, one pass
    per run of tensors instead of one per tensor). Held while entered, so their ids stay unique."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self.tensors = {id(t): t for t in tensors}
        self._outer: list[dict[int, torch.Tensor] | None] = []

    def __enter__(self) -> KnownFinite:
        self._outer.append(getattr(_CASTS, "finite", None))
        _CASTS.finite = self.tensors
        return self

    def __exit__(self, *exc: object) -> None:
        _CASTS.finite = self._outer.pop()


# the exponent bits of a dtype (all set: Inf or NaN), in its same-width integer view
_EXPONENT = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}
SMALL_FACTOR = 1 << 22  # elements: below, the finite check is one numpy pass on the calling thread


def _small_finite(tensor: torch.Tensor) -> bool | None:
    """Whether a small CPU factor is finite, read from its exponent bits by numpy on this thread (None: not
    such a tensor). torch's aminmax makes a parallel region of it, which on a busy host waits for a
    descheduled thread, up to ~40 ms for a rank-16 factor (issue 39)."""
    spec = _EXPONENT.get(tensor.dtype)
    if spec is None or tensor.device.type != "cpu" or tensor.numel() > SMALL_FACTOR:
        return None
    view, mask = spec
    exponent = tensor.detach().contiguous().view(view).numpy() & mask
    return not bool(np.any(exponent == mask))


def check_factor(name: str, tensor: torch.Tensor) -> None:
    """Factors must be floating point and finite (meta tensors: shape-only planning, values unknown)."""
    if not tensor.is_floating_point():
        raise PartRejected(
            "bad_tensor", f"bad tensor: {name} has dtype {tensor.dtype}, expected floating point"
        )
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return
    known = getattr(_CASTS, "finite", None)
    if known is not None and known.get(id(tensor)) is tensor:
        return
    small = _small_finite(tensor)
    try:
        if small is not None:
            finite = small
        else:  # NaN and ±Inf propagate into min/max: one pass, no bool temporary (isfinite().all(): ~8x)
            lo, hi = torch.aminmax(tensor)
            finite = math.isfinite(lo.item()) and math.isfinite(hi.item())
    except (
        RuntimeError,
        NotImplementedError,
    ):  # dtypes without aminmax/isfinite here (float8): check in fp32
        finite = bool(torch.isfinite(tensor.float()).all())
    if not finite:
        raise PartRejected("non_finite", f"bad tensor: {name} holds NaN or Inf")


def check_factors(
    tensors: dict[str, torch.Tensor], key_of: dict[str, str], skip: tuple[str, ...] = ()
) -> None:
    """check_factor on every tensor of a part but the `skip` roles (scalars such as alpha)."""
    for role, t in tensors.items():
        if role not in skip:
            check_factor(key_of[role], t)


def refuse_roles(family: str, roles: set[str], key_of: dict[str, str]) -> None:
    """Refuse a `family` part that holds `roles` (roles it has no use for), naming their keys."""
    if roles:
        raise PartRejected(
            "unsupported",
            f"unsupported family: {family} part with {', '.join(sorted(key_of[r] for r in roles))}",
        )


def is_channel_vector(t: torch.Tensor) -> bool:
    """A conv-layout per-channel vector (1, n, 1, …)."""
    return t.dim() >= 3 and t.shape[0] == 1 and all(d == 1 for d in t.shape[2:])
