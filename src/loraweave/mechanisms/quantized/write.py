"""Mechanisms for quantized layers: exact factor channel, hosted truncation, requantize, and the rule between
them.

Each writes through the layer's backend (quant/), keeps the backend's bit-exact undo, and can rewrite itself
from the original tensors when a strength changes. Runtime (hooks) lives in runtime.py and needs nothing from
here."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...arch.spec import module_shape
from ...families.contribution import add_contribution
from ...modes import QuantMechanism
from ...quant.backend import FactorSlot, QuantBackend, Restore
from ...resolve.planner import PlannedPart
from ...resolve.stacking import Contribution
from ..merge.checks import needs_bias, refuse_non_finite
from ..merge.undo import recorded_threads
from .hosted import Truncation, truncate

log = logging.getLogger("loraweave")

REQUANT_RATIO = 0.30  # rms(Δ)/grid step above which the grid can hold the delta
REQUANT_ENERGY = 0.90  # hosting that captures less than this loses to requantizing a fat delta
STACK_ATTR = "_loraweave_quant"  # per-module list of live quantized writes, newest last


class HostedCache(Protocol):
    """What hosting reads of a factor cache (mechanisms/runtime/factor_cache.py FactorCache)."""

    def signature(
        self, module: torch.nn.Module, layer: str, contributions: list[Contribution], host_rank: int
    ) -> str | None: ...

    def load(self, sig: str) -> Truncation | None: ...

    def store(self, sig: str, trunc: Truncation) -> Truncation: ...


def _coeff(pp: PlannedPart) -> float:
    return pp.strength * pp.scale


def part_factorable(pp: PlannedPart, module: torch.nn.Module) -> bool:
    """A plain 2-D LoRA part (no bias, no DoRA, no kernel): its factors ride a side channel exactly."""
    f = pp.factors
    if pp.part.family != "lora" or getattr(f, "up_bias", None) is not None:
        return False
    shape = module_shape(module)
    return shape is not None and len(shape) == 2 and f.down.flatten(1).shape[1] == shape[1]


def factorable_reason(module: torch.nn.Module, contribs: list[Contribution]) -> str | None:
    """Why this set cannot ride the side channel exactly, or None when every part is a plain LoRA."""
    bad = sorted({pp.part.family for pp, _ in contribs if not part_factorable(pp, module)})
    return f"not a plain LoRA ({', '.join(bad)})" if bad else None


def exact_ups(contribs: list[Contribution], out: int, device: torch.device | None = None) -> torch.Tensor:
    """Rank-concatenated up (out, R) fp32 with strength·scale folded in (a fresh tensor)."""
    ups = []
    for pp, piece in contribs:
        f = pp.factors
        rows = f.up[piece.src_start : piece.src_start + piece.length]
        target = device or f.up.device
        if piece.dst_start == 0 and piece.length == out:  # every row: one pass, no zero fill
            ups.append(rows.to(target, torch.float32) * _coeff(pp))
            continue
        up = torch.zeros(out, f.up.shape[1], dtype=torch.float32, device=target)
        up[piece.dst_start : piece.dst_start + piece.length] = rows.to(target, torch.float32)
        ups.append(up.mul_(_coeff(pp)))
    return ups[0] if len(ups) == 1 else torch.cat(ups, dim=1)


def exact_factors(
    contribs: list[Contribution], out: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-concatenated (down (R, in), up (out, R)) fp32 with strength·scale folded into up."""
    up = exact_ups(contribs, out, device)
    downs = [pp.factors.down.flatten(1).to(up.device, torch.float32) for pp, _ in contribs]
    return torch.cat(downs), up


def intended_delta(
    contribs: list[Contribution], shape: tuple[int, ...], base: torch.Tensor | None
) -> torch.Tensor:
    """Σ coeff·ΔW of the contributions, fp32 (out, in·k), each from the ORIGINAL weight `base` where it needs
    one."""
    device = base.device if base is not None else None  # factors are cast into the rows by each family
    acc = torch.zeros(shape[0], int(torch.Size(shape[1:]).numel()), dtype=torch.float32, device=device)
    base2d = base.reshape(shape[0], -1) if base is not None else None
    for pp, piece in contribs:
        add_contribution(acc[piece.dst_start : piece.dst_start + piece.length], pp, piece, base2d)
    return acc


def retention(applied: torch.Tensor, intended: torch.Tensor) -> float:
    """ρ = <applied Δ, intended Δ> / ‖intended Δ‖² (1.0: all of it landed; 0: erased)."""
    intended = intended.double()
    denom = float(intended.pow(2).sum())
    return (
        1.0 if denom == 0.0 else float((applied.to(intended.device, torch.float64) * intended).sum()) / denom
    )


def rank_bucket(rank: int) -> int:
    """Pad ranks so that compiled forwards see few distinct shapes: ≤8 → 8, ≤256 → power of two, else ×64."""
    if rank <= 8:
        return 8
    if rank <= 256:
        return 1 << (rank - 1).bit_length()
    return -(-rank // 64) * 64


@dataclass
class Route:
    mechanism: QuantMechanism | None  # None: cannot
    why: str
    truncation: Truncation | None = None  # computed while routing, reused by the first write
    delta: torch.Tensor | None = None
    cache_hit: bool | None = None


def host_factors(
    delta: torch.Tensor,
    rest: list[Contribution],
    module: torch.nn.Module,
    host_rank: int,
    cache: HostedCache | None = None,
    layer: str = "",
) -> tuple[Truncation, bool | None]:
    """The hosted truncation of `delta`, replayed from `cache` when it holds this exact configuration."""
    sig = cache.signature(module, layer, rest, host_rank) if cache is not None else None
    if cache is None or sig is None:
        return truncate(delta, host_rank), None
    hit = cache.load(sig)
    if hit is not None:
        return hit, True
    return cache.store(sig, truncate(delta, host_rank)), False


def route_hook_free(
    backend: QuantBackend,
    module: torch.nn.Module,
    contribs: list[Contribution],
    host_rank: int,
    force_requantize: bool = False,
    cache: HostedCache | None = None,
    layer: str = "",
) -> Route:
    """Hook-free choice on a quantized layer: factor channel, else hosting vs requantizing (the routing
    rule)."""
    caps = backend.capabilities(module)
    if needs_bias(contribs):
        return Route(None, "bias deltas on a quantized layer ride only the runtime path")
    not_factorable = factorable_reason(module, contribs)
    if force_requantize:
        return (
            Route("requantize", "requantize requested")
            if caps.requantize
            else Route(None, f"cannot requantize: {caps.reason}")
        )
    if caps.factor_channel and not_factorable is None:
        return Route("factor", "plain LoRA set rides the side channel exactly")
    can_host = caps.factor_channel and caps.dequantize and host_rank > 0  # the delta is formed from W
    if not caps.requantize:
        return (
            Route("hosted", "backend cannot requantize")
            if can_host
            else Route(None, f"cannot requantize or host: {caps.reason}")
        )
    bits = backend.bits(module)
    if bits >= 8:
        return Route("requantize", f"{bits}-bit grid keeps the delta")
    if not can_host:
        why = "host_rank=0" if caps.factor_channel else f"no side channel ({caps.reason})"
        return Route("requantize", why)
    return _host_or_requantize(backend, module, contribs, host_rank, cache, layer)


def _host_or_requantize(
    backend: QuantBackend,
    module: torch.nn.Module,
    contribs: list[Contribution],
    host_rank: int,
    cache: HostedCache | None,
    layer: str,
) -> Route:
    """Low-bit layer that could do either: host the truncated delta unless it is fat (large against the grid
    step and poorly captured at host_rank); factorable members or a checkpoint SVD always host."""
    exact = [c for c in contribs if part_factorable(c[0], module)]
    rest = [c for c in contribs if not part_factorable(c[0], module)]
    shape = module_shape(module)
    assert shape is not None  # a planned quantized layer has a logical weight shape
    base = backend.dequantize(module)
    delta = intended_delta(rest, shape, base)
    trunc, hit = host_factors(delta, rest, module, host_rank, cache, layer)
    if exact or backend.has_checkpoint_svd(module):
        return Route(
            "hosted", "factorable members or a checkpoint SVD ride the side channel", trunc, delta, hit
        )
    ratio = float(delta.pow(2).mean().sqrt()) / max(backend.grid_step(module), 1e-30)
    if ratio > REQUANT_RATIO and trunc.energy < REQUANT_ENERGY:
        return Route(
            "requantize",
            f"fat delta: rms/step={ratio:.3g} > {REQUANT_RATIO}, capture={trunc.energy:.3g} < "
            f"{REQUANT_ENERGY}",
        )
    return Route("hosted", f"rms/step={ratio:.3g}, capture={trunc.energy:.3g}", trunc, delta, hit)


@dataclass(eq=False)  # identity semantics: compared with `is` on the per-module stack
class QuantWrite:
    """One live write into a quantized layer (factor, hosted or requantize); undo restores the originals."""

    module: torch.nn.Module
    backend: QuantBackend
    contributions: list[Contribution]
    mechanism: str
    host_rank: int = 0
    cache: HostedCache | None = None  # a FactorCache: hosted factors replayed instead of recomputed
    layer: str = ""  # component.path, part of the cache signature
    adapters: set[str] = field(default_factory=set)
    retention: float | None = None
    capture: float | None = None  # hosted: energy the truncation kept
    rank: int = 0
    cache_hit: bool | None = None
    entry: object | None = None  # the report's AppliedModule, refreshed after a strength change
    _undo: Restore | None = None
    _first: Route | None = None

    def is_top(self) -> bool:
        stack = getattr(self.module, STACK_ATTR, [])
        return bool(stack) and stack[-1] is self

    def apply(self, first: Route | None = None) -> None:
        self.adapters = {pp.adapter.name for pp, _ in self.contributions}
        self._first = first
        if not hasattr(self.module, STACK_ATTR):
            setattr(self.module, STACK_ATTR, [])
        getattr(self.module, STACK_ATTR).append(self)
        self.write()

    def write(self) -> None:
        """(Re)write from the original tensors, so strength changes never compound requantization error."""
        # A factor write is element-wise work on rank x width tensors (no reduction: the same bits on any
        # thread count); OpenMP's fork/join costs more than a second thread saves, and stalls on a busy core.
        with recorded_threads(1 if self.mechanism == "factor" else torch.get_num_threads()):
            self._write()

    def _write(self) -> None:
        if self._undo is not None and self._rescaled():
            return
        if self._undo is not None:
            self._undo()
            self._undo = None
        if self.mechanism == "requantize":
            self._requantize()
        else:
            self._ride()
        self._first = None

    def _rescaled(self) -> bool:
        """A factor write on top of its layer whose backend rescales in place: only the up factors change
        with strength (they carry strength·scale), so they are rewritten where they lie."""
        slot = self._undo
        if self.mechanism != "factor" or not isinstance(slot, FactorSlot) or not self.is_top():
            return False
        shape = module_shape(self.module)
        assert shape is not None  # a planned quantized layer has a logical weight shape
        return slot.rescale(exact_ups(self.contributions, shape[0]))

    def _ride(self) -> None:
        shape = module_shape(self.module)
        assert shape is not None  # a planned quantized layer has a logical weight shape
        exact = [c for c in self.contributions if part_factorable(c[0], self.module)]
        rest = [c for c in self.contributions if not part_factorable(c[0], self.module)]
        downs, ups = [], []
        exact_delta: torch.Tensor | float = 0.0
        base = (
            self.backend.dequantize(self.module)
            if rest and (self._first is None or self._first.delta is None)
            else None
        )
        if exact:
            d, u = exact_factors(exact, shape[0], base.device if base is not None else None)
            downs.append(d)
            ups.append(u)
            exact_delta = u @ d if rest else 0.0  # only hosted layers need it, for ρ
        delta = None
        if rest:
            delta, trunc = self._hosted(rest, shape, base)
            self.capture = trunc.energy
            downs.append(trunc.down)
            ups.append(trunc.up)
        if rest:  # a hosted truncation may be a factor cache's own tensors: always a copy
            down, up = torch.cat(downs), torch.cat(ups, dim=1)
        else:  # exact_factors made a fresh pair: no second copy
            down, up = downs[0], ups[0]
        self.rank = down.shape[0]
        pad = rank_bucket(self.rank) - self.rank
        if pad:  # zero rows/columns: same product, fewer distinct shapes under torch.compile
            down = torch.cat([down, down.new_zeros(pad, down.shape[1])])
            up = torch.cat([up, up.new_zeros(up.shape[0], pad)], dim=1)
        self._undo = self.backend.append_factors(self.module, down, up)
        if delta is not None:  # hosted members (rest): ρ against everything this write stands for
            exact_part = exact_delta.to(delta.device) if isinstance(exact_delta, torch.Tensor) else 0.0
            self.retention = retention(up @ down, delta + exact_part)
        else:
            self.retention = 1.0

    def _hosted(
        self, rest: list[Contribution], shape: tuple[int, ...], base: torch.Tensor | None
    ) -> tuple[torch.Tensor, Truncation]:
        """(ΔW of the non-factorable members, its truncation at host_rank); the routing's when it has them."""
        first = self._first
        delta = first.delta if first is not None and first.delta is not None else None
        if delta is None:
            delta = intended_delta(rest, shape, base)
        if first is not None and first.truncation is not None:
            trunc, self.cache_hit = first.truncation, first.cache_hit
        else:
            trunc, self.cache_hit = host_factors(
                delta, rest, self.module, self.host_rank, self.cache, self.layer
            )
        return delta, trunc

    def _requantize(self) -> None:
        shape = module_shape(self.module)
        assert shape is not None  # a planned quantized layer has a logical weight shape
        base = self.backend.dequantize(self.module)
        delta = intended_delta(self.contributions, shape, base)
        target = base + delta.view(base.shape)
        refuse_non_finite(target, base, self.adapters)  # before the storage is touched
        self._undo = self.backend.requantize(self.module, target)
        after = self.backend.dequantize(self.module)
        self.retention = retention(after - base, delta.view(base.shape))

    def undo(self) -> None:  # a journal entry
        self.restore()

    def restore(self) -> None:
        stack = getattr(self.module, STACK_ATTR, [])
        if any(w is self for w in stack):
            stack.remove(self)
        if self._undo is not None:
            self._undo()
            self._undo = None
