"""Several adapters on one layer combined by a stack mode (TIES, DARE, magnitude prune) into one dense ΔW.

Never read from a file: `apply(stack=...)` builds it for layers that two or more adapters touch. Each adapter
gives one task delta over the whole module (rows it does not cover are zero). Families linear in strength give
it at unit strength and weigh it by their strength (PEFT semantics: TIES elects signs before the weights);
the others (OFT, DoRA, ...) give it at their strength with weight 1. A strength change recomputes on the next
write (merge) or forward (runtime); the result is cached per strengths, so forwards reuse it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..arch.spec import Piece
from ..report.miss import Miss
from ..stack.combine import combine_deltas
from .base import ConvSpec, Family, PartRejected, RuntimeTerm
from .contribution import Planned, add_contribution


@dataclass(eq=False)
class CombinedFactors:
    sources: list[tuple[Planned, Piece]]  # (PlannedPart, Piece) landing on this module
    mode: str
    density: float | None
    key: str  # names layer, adapters and settings: DARE masks derive from it
    shape: tuple[int, ...]  # the module's logical weight shape
    rank: int | None = None
    is_conv_kernel: bool = False
    _cache: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.shape[0]

    def _signature(self) -> tuple[tuple[float, float], ...]:
        return tuple((pp.strength, pp.scale) for pp, _ in self.sources)

    def delta(self, base: torch.Tensor | None) -> torch.Tensor:
        """The combined ΔW, (rows, in·k) fp32; `base` = original weight rows (needed by W-dependent
        families)."""
        sig = self._signature()
        if self._cache.get("sig") == sig:
            cached: torch.Tensor = self._cache["delta"]
            return cached
        by_adapter: dict[str, list[tuple[Planned, Piece]]] = {}
        for pp, piece in self.sources:
            by_adapter.setdefault(pp.adapter.name, []).append((pp, piece))
        cols = int(torch.Size(self.shape[1:]).numel())
        deltas: list[torch.Tensor] = []
        weights: list[float] = []
        for contribs in by_adapter.values():
            linear = all(not pp.family.needs_base for pp, _ in contribs)
            strengths = {pp.strength for pp, _ in contribs}
            unit = linear and len(strengths) == 1
            delta = torch.zeros(self.shape[0], cols)
            for pp, piece in contribs:
                coeff = pp.scale if unit else pp.strength * pp.scale
                try:
                    add_contribution(
                        delta[piece.dst_start : piece.dst_start + piece.length], pp, piece, base, coeff
                    )
                except PartRejected as rejected:
                    raise PartRejected(rejected.miss.kind, f"stack={self.mode}: {rejected}") from None
            deltas.append(delta)
            weights.append(strengths.pop() if unit else 1.0)
        combined = combine_deltas(deltas, weights, self.mode, self.density, self.key)
        self._cache = {"sig": sig, "delta": combined}
        return combined


def load(tensors: dict[str, torch.Tensor], key_of: dict[str, str]) -> CombinedFactors:
    raise PartRejected(
        "unsupported", "unsupported family: combined parts are built by apply(stack=...), never read"
    )


def check_target(f: CombinedFactors, shape: tuple[int, ...]) -> Miss | None:
    if tuple(shape) == tuple(f.shape):
        return None
    return Miss("shape_mismatch", f"shape mismatch: combined {f.shape} vs module {shape}")


def add_delta(
    target_rows: torch.Tensor,
    f: CombinedFactors,
    src: int,
    length: int,
    coeff: float,
    base: torch.Tensor | None = None,
    strength: float = 1.0,
    scale: float = 1.0,
) -> None:
    target_rows.add_(f.delta(base)[src : src + length].to(target_rows.dtype), alpha=coeff)


def bias_delta(f: CombinedFactors, src: int, length: int) -> torch.Tensor | None:
    """Bias deltas are summed (the stack modes act on weights), each at its strength."""
    total = None
    for pp, piece in f.sources:
        b = pp.family.bias(pp.factors, piece.src_start, piece.length, None)
        if b is None:
            continue
        total = torch.zeros(f.shape[0]) if total is None else total
        total[piece.dst_start : piece.dst_start + piece.length] += b.float() * (pp.strength * pp.scale)
    return None if total is None else total[src : src + length]


def runtime_term(
    f: CombinedFactors, src: int, dst: int, length: int, module: torch.nn.Module | None = None
) -> RuntimeTerm:
    weight = getattr(module, "weight", None)
    float_weight = (
        weight
        if isinstance(weight, torch.Tensor)
        and type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.is_floating_point()
        else None
    )  # W-dependent sources read the layer's original rows
    cast: dict[str, Any] = {}

    def fn(
        x: torch.Tensor, conv: ConvSpec | None, base_out: torch.Tensor | None, strength: float, scale: float
    ) -> torch.Tensor:
        base = float_weight.detach().reshape(f.shape[0], -1) if float_weight is not None else None
        delta = f.delta(base)
        key = (id(delta), x.device, x.dtype)
        if cast.get("key") != key:
            rows = delta[src : src + length]
            cast.update(
                key=key, w=(rows.reshape(length, *f.shape[1:]) if conv else rows).to(x.device, x.dtype)
            )
        w: torch.Tensor = cast["w"]
        out = conv.fn(x, w, None, **conv.kwargs) if conv else F.linear(x, w)
        bias = bias_delta(f, src, length)  # at the live strengths, like the weight part
        if bias is not None:
            bias = bias.to(out.device, out.dtype)
            out = out + (bias.view(-1, *([1] * (out.dim() - 2))) if conv else bias)
        return out

    return RuntimeTerm.structured(
        dst,
        length,
        fn=fn,
        cost=f"stack={f.mode}: dense ΔW cached per strengths",
        linear_in_strength=False,
        unheld="the combined dense ΔW, rebuilt per strengths",
    )


SPEC = Family(
    "combined",
    load,
    check_target,
    add_delta_from_base=add_delta,
    bias_delta=bias_delta,
    host_runtime_term=runtime_term,
    roles=(),
)
