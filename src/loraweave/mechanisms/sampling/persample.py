"""Per-sample adapter sets: validation, and each layer's factors and coefficients for one set.

A set is a tuple of (adapter name, strength) pairs. For the rank-concatenated pair of a layer, the set's
factors are the rank segments of its adapters (a view when they are contiguous, one gathered copy per set
otherwise) with the set's per-rank scale; other terms (LoKr, LoHa, dense, bias, OFT/DoRA...) take the set's
coefficient per part."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from ...errors import BatchError
from ...resolve.planner import PlannedPart
from ...resolve.weights import AdapterWeights, part_strength
from ..runtime.path import RuntimePath

SampleKey = tuple[tuple[str, float], ...]


def _strength(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BatchError(f"{where}: strength must be a finite number, got {value!r}")
    return float(value)


def _one_sample(i: int, names: object, strengths: object, known: Mapping[str, float]) -> SampleKey:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise BatchError(f"sample {i}: expected a list of adapter names, got {names!r}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BatchError(f"sample {i}: no adapter named {unknown[0]!r}; have {sorted(known)}")
    if len(set(names)) != len(names):
        raise BatchError(f"sample {i}: an adapter is named twice in {list(names)}")
    if strengths is None:
        values = [known[n] for n in names]
    elif isinstance(strengths, Mapping):
        extra = sorted(set(strengths) - set(names))
        if extra:
            raise BatchError(f"sample {i}: strengths for {extra}, which the sample does not use")
        values = [strengths.get(n, known[n]) for n in names]
    elif isinstance(strengths, Sequence) and not isinstance(strengths, str) and len(strengths) == len(names):
        values = list(strengths)
    else:
        raise BatchError(
            f"sample {i}: strengths must be a mapping or a list of {len(names)} numbers, got {strengths!r}"
        )
    # In the caller's order: a set's terms are summed in it (as `apply` sums adapters in list order), so a
    # sample's float result is the one a lone apply of the same list gives (cache keys differ only by that
    # order).
    return tuple((n, _strength(v, f"sample {i} adapter {n!r}")) for n, v in zip(names, values, strict=True))


def sample_keys(assignments: object, strengths: object, known: Mapping[str, float]) -> list[SampleKey]:
    """One key per sample; `known` maps each adapter name to its current strength (the default)."""
    if isinstance(assignments, (str, Mapping)) or not isinstance(assignments, Sequence) or not assignments:
        raise BatchError(
            f"assignments must be a non-empty list with one list of adapter names per sample, got "
            f"{assignments!r}"
        )
    if strengths is not None and (not isinstance(strengths, Sequence) or len(strengths) != len(assignments)):
        raise BatchError(f"strengths must have one entry per sample ({len(assignments)}), got {strengths!r}")
    per = strengths if strengths is not None else [None] * len(assignments)
    return [
        _one_sample(i, names, s, known) for i, (names, s) in enumerate(zip(assignments, per, strict=True))
    ]


def part_strength_for(
    path: RuntimePath, pp: PlannedPart, key: SampleKey | None, settings: Mapping[str, AdapterWeights]
) -> float:
    """The part's strength on this layer for a sample set (None: the handle's current strengths)."""
    if key is None:
        return path.strength_of(pp)
    value = dict(key).get(pp.adapter.name)
    if value is None:
        return 0.0
    w = settings[pp.adapter.name]
    return part_strength(pp, replace(w, strength=value)) * path.gates.get(pp.adapter.name, 1.0)


class PairFactors:
    """A layer's low-rank pair restricted to one set: down (r, in, *k), up (out, r), scale (r,), and the rank
    segment (start, stop, adapter name) of each of its adapters, for regions."""

    def __init__(
        self, down: torch.Tensor, up: torch.Tensor, scale: torch.Tensor, segments: list[tuple[int, int, str]]
    ) -> None:
        self.down, self.up, self.scale, self.segments = down, up, scale, segments


def pair_for(
    path: RuntimePath,
    key: SampleKey | None,
    settings: Mapping[str, AdapterWeights],
    device: torch.device,
    dtype: torch.dtype,
) -> PairFactors | None:
    """The set's part of the layer's rank-concatenated pair, on (device, dtype); None when it has no rank
    there."""
    if path.down is None:
        return None
    down, up, scale = path.factors_for(device, dtype)
    if key is None:
        segments, start = [], 0
        for span in path.owners:
            segments.append((start, start + span.rank, span.part.adapter.name))
            start += span.rank
        return PairFactors(down, up, scale, segments)
    order = {name: i for i, (name, _) in enumerate(key)}
    found, start = [], 0
    for span in path.owners:
        pp = span.part
        coeff = part_strength_for(path, pp, key, settings) * pp.scale
        if coeff != 0.0:
            found.append((order[pp.adapter.name], start, span.rank, coeff, pp.adapter.name))
        start += span.rank
    if not found:
        return None
    # Rank segments in the set's own order (stable within an adapter): the rank sum then runs as in a lone
    # apply.
    found.sort(key=lambda f: f[0])
    keep, coeffs, segments, width = [], [], [], 0
    for _, begin, rank, coeff, name in found:
        keep.append((begin, begin + rank))
        coeffs.append(torch.full((rank,), coeff, dtype=dtype, device=device))
        segments.append((width, width + rank, name))
        width += rank
    if all(a[1] == b[0] for a, b in zip(keep, keep[1:], strict=False)):  # contiguous: views, nothing copied
        rows = slice(keep[0][0], keep[-1][1])
        # up's column slice made contiguous: the thin-GEMM kernel (mechanisms/runtime/skinny.py) takes
        # contiguous factors only
        d, u = down[rows], up[:, rows].contiguous()
    else:
        index = torch.cat([torch.arange(a, b, device=device) for a, b in keep])
        d, u = down.index_select(0, index), up.index_select(1, index)
    return PairFactors(d, u, torch.cat(coeffs), segments)


def row_gates(
    path: RuntimePath,
    runs: Sequence[tuple[slice, SampleKey | None]],
    settings: Mapping[str, AdapterWeights],
    rows: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(rows, R): each row's coefficient for every rank of the layer's whole pair (0 outside its sample's
    set)."""
    per_key: dict[SampleKey | None, torch.Tensor] = {}
    rank = path.down.shape[0] if path.down is not None else 0  # called only for a layer with a pair
    gates = torch.zeros(rows, rank, dtype=torch.float32)
    for run, key in runs:
        if key not in per_key:
            per_key[key] = torch.tensor(
                [
                    part_strength_for(path, span.part, key, settings) * span.part.scale
                    for span in path.owners
                    for _ in range(span.rank)
                ]
            )
        gates[run] = per_key[key]
    return gates.to(device, dtype)
