"""Per-sample adapter sets and regional masks in one forward: the terms a RuntimePath adds, computed per run
of rows.

While a handle has a batch or a region, each of its RuntimePaths hands its adapter terms to this object. A
layer's input rows are split into runs of consecutive rows whose samples share one set (rows.py); each run is
a view of the input and of the output, so every set costs its own rank only (a segmented matmul:
x_run·Dₛᵀ·diag(scale)·Uₛᵀ added into the output run in place; no gather, no scatter). Regional adapters scale
their rank columns of h (and their structured terms) by a weight per output token (region.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

from ...errors import BatchError
from ...families.base import ConvSpec
from ...resolve.planner import PlannedPart
from ...resolve.weights import AdapterWeights
from ..runtime.path import RuntimePath
from ..runtime.skinny import skinny_linear
from .persample import PairFactors, SampleKey, pair_for, part_strength_for, row_gates, sample_keys
from .region import token_weights
from .rows import RootCall, RootProbe, sample_runs

# Below this many (tokens per run x total rank), per-row gating of the whole pair replaces per-run GEMMs.
GATED_MAX_TOKEN_RANKS = 16384

Runs = Sequence[tuple[slice, SampleKey | None]]  # rows of a layer's input and their set (None: the handle's)
Weights = dict[str, torch.Tensor | float]  # region weight per adapter name (per token, or a number)
Strength = Callable[[PlannedPart], float]


class WrittenLayer(Protocol):
    """A layer whose weight (or quantized storage) holds adapter terms."""

    @property
    def adapters(self) -> set[str]: ...


class Mix:
    """The per-sample sets and regions of one handle, and the per-layer caches they need."""

    def __init__(
        self, roots: dict[str, torch.nn.Module], names: dict[int, str], settings: Mapping[str, AdapterWeights]
    ) -> None:
        self.probe = RootProbe(roots)
        self.root_class = {name: type(root).__name__ for name, root in roots.items()}
        self.names = names  # id(path) -> "component.module", for messages
        self.settings = settings  # the handle's AdapterWeights by adapter name (live)
        self.keys: list[SampleKey] | None = None
        self.exact = False  # per-run own-set GEMMs only (no gated short-run form): see `batch`
        self.regions: dict[str, torch.Tensor] = {}
        self._pairs: dict[tuple[int, SampleKey | None, torch.device, torch.dtype], PairFactors | None] = {}
        self._runs: dict[tuple[str, RootCall | None, int], list[tuple[slice, SampleKey]]] = {}
        self._weights: dict[
            tuple[str, str, RootCall | None, tuple[int, ...], bool, torch.device, torch.dtype],
            torch.Tensor | float,
        ] = {}
        self._gates: dict[tuple[int, int, int, torch.device, torch.dtype], torch.Tensor] = {}

    def set_batch(
        self, assignments: object, strengths: object, known: Mapping[str, float], exact: bool = False
    ) -> None:
        self.keys = sample_keys(assignments, strengths, known)
        self.exact = bool(exact)
        self._pairs.clear()
        self._runs.clear()

    def clear_batch(self) -> None:
        self.keys = None
        self.exact = False
        self._pairs.clear()
        self._runs.clear()
        self._gates.clear()

    def set_region(self, name: str, mask: torch.Tensor) -> None:
        self.regions[name] = mask  # checked by check_mask
        self._weights.clear()

    def clear_region(self, name: str) -> None:
        self.regions.pop(name, None)
        self._weights.clear()

    @property
    def idle(self) -> bool:
        return self.keys is None and not self.regions

    def remove(self) -> None:
        self.probe.remove()

    def _component(self, path: RuntimePath) -> str:
        return path.contributions[0][0].component

    def _runs_for(self, path: RuntimePath, rows: int, keys: list[SampleKey]) -> list[tuple[slice, SampleKey]]:
        comp = self._component(path)
        call = self.probe.calls.get(comp)
        cache = (comp, call, rows)
        if cache not in self._runs:
            runs: list[tuple[slice, SampleKey]] = []
            for start, stop, sample in sample_runs(
                call, rows, len(keys), self.names.get(id(path), "a layer")
            ):
                key = keys[sample]
                if runs and runs[-1][1] == key and runs[-1][0].stop == start:
                    runs[-1] = (slice(runs[-1][0].start, stop), key)  # neighbours with one set: one segment
                else:
                    runs.append((slice(start, stop), key))
            self._runs[cache] = runs
        return self._runs[cache]

    def _weights_for(self, path: RuntimePath, out: torch.Tensor) -> Weights:
        names = [n for n in self.regions if n in path.adapters]
        if not names:
            return {}
        comp = self._component(path)
        call = self.probe.calls.get(comp)
        found: Weights = {}
        for name in names:
            cache = (name, comp, call, tuple(out.shape[1:]), path.channels_first, out.device, out.dtype)
            if cache not in self._weights:
                w = token_weights(
                    self.regions[name],
                    call,
                    self.root_class[comp],
                    tuple(out.shape),
                    path.channels_first,
                    self.names.get(id(path), "a layer"),
                )
                self._weights[cache] = w.to(out.device, out.dtype) if isinstance(w, torch.Tensor) else w
            found[name] = self._weights[cache]
        return found

    def _pair(self, path: RuntimePath, key: SampleKey | None, out: torch.Tensor) -> PairFactors | None:
        cache = (id(path), key, out.device, out.dtype)
        if (
            key is None
        ):  # the handle's own strengths: the path's cast factors, never cached here (they may change)
            return pair_for(path, None, self.settings, out.device, out.dtype)
        if cache not in self._pairs:
            self._pairs[cache] = pair_for(path, key, self.settings, out.device, out.dtype)
        return self._pairs[cache]

    def add(self, path: RuntimePath, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """RuntimePath.add_path while this mix is set: every term, per run of rows and per token."""
        out = output if path.inplace_ok(output) else output.clone()
        self._each(path, x, out, fresh=False)
        return out

    def fused_linear(self, path: RuntimePath, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
        """A plain Linear's forward with each run's low-rank term in the GEMM's accumulator, as the fused path
        does: out[run] = bias + h_run·Uₛᵀ (written once), then out += x·Wᵀ (one pass over the output
        fewer)."""
        out = x.new_empty(*x.shape[:-1], path.out)
        self._each(path, x, out, fresh=True)
        out.view(-1, path.out).addmm_(x.reshape(-1, x.shape[-1]), linear.weight.t())
        return out

    def _each(self, path: RuntimePath, x: torch.Tensor, out: torch.Tensor, fresh: bool) -> None:
        runs: Runs = (
            [(slice(None), None)] if self.keys is None else self._runs_for(path, x.shape[0], self.keys)
        )
        if self.exact and len({key for _, key in runs}) > 1:
            self._each_set(path, x, out, runs, fresh)
            return
        gated = self._gated(path, x, out, runs, fresh)
        for rows, key in runs:
            if key == () and (gated or not fresh):
                continue  # a sample without adapters: the base output as it is
            outs = out[rows]
            weights = self._weights_for(path, outs) if key != () else {}
            _terms(self, path, x[rows], outs, key, weights, fresh and not gated, pair_done=gated)

    def _each_set(
        self, path: RuntimePath, x: torch.Tensor, out: torch.Tensor, runs: Runs, fresh: bool
    ) -> None:
        """`exact`, several sets: each set's terms over every row, as a lone apply of it computes them (the
        same shapes, so the same CPU kernels: BLAS and oneDNN round by row count), kept on that set's rows
        only. Costs a low-rank pass over all rows per set (the gated form's FLOPs) and one output-sized
        buffer."""
        base = None if fresh else out.clone()
        buffer = out.new_empty(out.shape) if base is None else base  # not fresh: a copy of base per set
        for key in dict.fromkeys(key for _, key in runs):
            if key == () and not fresh:
                continue  # a sample without adapters: the base output as it is
            buffer = buffer if base is None else base.clone()
            _terms(self, path, x, buffer, key, self._weights_for(path, buffer) if key != () else {}, fresh)
            for rows, mine in runs:
                if mine == key:
                    out[rows] = buffer[rows]

    def _gated(self, path: RuntimePath, x: torch.Tensor, out: torch.Tensor, runs: Runs, fresh: bool) -> bool:
        """Short runs (modulation inputs (B, C), few tokens): one pass of the whole rank-concatenated pair
        with a per-row gate beats a few small GEMMs per run. Returns whether it ran (then only other terms
        remain)."""
        if self.exact or len(runs) < 2 or path.conv or path.down is None or path.base_fns or out.dim() < 2:
            return False  # terms that read the base output must see it before any pair is added
        tokens = (runs[0][0].stop - runs[0][0].start) * math.prod(x.shape[1:-1])
        if tokens * path.down.shape[0] >= GATED_MAX_TOKEN_RANKS:
            return False
        cache = (id(path), runs[0][0].stop, x.shape[0], out.device, out.dtype)
        if cache not in self._gates:
            self._gates[cache] = row_gates(path, runs, self.settings, x.shape[0], out.device, out.dtype)
        down, up, scale = path.factors_for(out.device, out.dtype)
        h = skinny_linear(x, down)
        h.view(x.shape[0], -1, h.shape[-1]).mul_(self._gates[cache][:, None, :])
        pair = pair_for(path, None, self.settings, out.device, out.dtype)
        assert pair is not None  # path.down is set (checked above): the handle's whole pair
        _weigh(h, pair, self._weights_for(path, out), channels_first=False)
        if fresh:  # h is formed and weighed: only the pair's factors are read
            _init_linear(path, x, out, PairFactors(down, up, scale, []), {}, h=h)
        else:
            out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), up.t())
        return True


def _put(
    path: RuntimePath,
    out: torch.Tensor,
    value: torch.Tensor,
    dst: int,
    n: int,
    alpha: float,
    weight: torch.Tensor | float | None,
) -> None:
    """out[rows] += alpha·weight·value in place (weight: per token, per pixel or a number)."""
    if weight is not None and not (isinstance(weight, float) and weight == 1.0):
        value = value * weight
    rows = slice(dst, dst + n)
    (out[:, rows] if path.channels_first else out[..., rows]).add_(value, alpha=alpha)


def _terms(
    mix: Mix,
    path: RuntimePath,
    x: torch.Tensor,
    out: torch.Tensor,
    key: SampleKey | None,
    weights: Weights,
    fresh: bool = False,
    pair_done: bool = False,
) -> None:
    """Add the set's terms to `out`; `fresh`: `out` is uninitialised and gets bias + low-rank term first (a
    fused plain Linear, whose paths have no terms that read the base output); `pair_done`: the low-rank pair
    is in."""
    strength: Strength = lambda pp: part_strength_for(path, pp, key, mix.settings)  # noqa: E731
    spec = ConvSpec(path.conv, path.conv_args()) if path.conv else None
    if path.base_fns:  # computed from the base output before anything is added to these rows
        _add_base_terms(path, x, out, spec, strength, weights)
    pair = mix._pair(path, key, out) if key != () and not pair_done else None
    if fresh:
        _init_linear(path, x, out, pair, weights)
        if key == ():
            return
    elif pair is not None:
        _add_pair(path, x, out, pair, weights)
    _add_other_terms(path, x, out, spec, strength, weights)


def _add_base_terms(
    path: RuntimePath,
    x: torch.Tensor,
    out: torch.Tensor,
    spec: ConvSpec | None,
    strength: Strength,
    weights: Weights,
) -> None:
    """The terms that read the layer's base output (without bias): all computed before any is added."""
    base = out
    bias = getattr(path.module, "bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.to(out.device, out.dtype)
        base = out - (b.view(-1, *([1] * (out.dim() - 2))) if path.channels_first else b)
    found: list[tuple[PlannedPart, torch.Tensor, int, int, float]] = []
    for t in path.base_fns:
        pp, dst, n, fn = t.part, t.dst, t.rows, t.fn
        s = strength(pp)
        if s == 0.0:
            continue
        rows = base[:, dst : dst + n] if path.channels_first else base[..., dst : dst + n]
        value, alpha = (
            (fn(x, spec, rows), s * pp.scale) if t.linear else (fn(x, spec, rows, s, pp.scale), 1.0)
        )
        found.append((pp, value, dst, n, alpha))
    for pp, value, dst, n, alpha in found:
        _put(path, out, value, dst, n, alpha, weights.get(pp.adapter.name))


def _add_other_terms(
    path: RuntimePath,
    x: torch.Tensor,
    out: torch.Tensor,
    spec: ConvSpec | None,
    strength: Strength,
    weights: Weights,
) -> None:
    """The dense, function and bias terms (those that read only x), each at its part's strength."""
    for t in path.dense:
        pp, dst, n = t.part, t.dst, t.rows
        s = strength(pp)
        if s != 0.0:
            (d,) = t.cache.to(out.device, out.dtype)
            value = path.conv(x, d, None, **path.conv_args()) if path.conv else F.linear(x, d)
            _put(path, out, value, dst, n, s * pp.scale, weights.get(pp.adapter.name))
    for f in path.fns:
        pp, dst, n, fn = f.part, f.dst, f.rows, f.fn
        s = strength(pp)
        if s != 0.0:
            value, alpha = (fn(x, spec), s * pp.scale) if f.linear else (fn(x, spec, None, s, pp.scale), 1.0)
            _put(path, out, value, dst, n, alpha, weights.get(pp.adapter.name))
    for t in path.biases:
        pp, dst, n = t.part, t.dst, t.rows
        s = strength(pp)
        if s != 0.0:
            (b,) = t.cache.to(out.device, out.dtype)
            b = b.view(-1, *([1] * (out.dim() - 2))) if path.channels_first else b
            _put(path, out, b, dst, n, s * pp.scale, weights.get(pp.adapter.name))


def _add_pair(
    path: RuntimePath, x: torch.Tensor, out: torch.Tensor, pair: PairFactors, weights: Weights
) -> None:
    """out += (x·Dᵀ·diag(scale) ⊙ region weights)·Uᵀ: region weights act on h (linear in it), per token."""
    if path.conv:
        h = path.conv(x, pair.down, None, **path.conv_args())
        h.mul_(pair.scale.view(1, -1, *([1] * (h.dim() - 2))))
        _weigh(h, pair, weights, channels_first=True)
        out.add_(path.conv(h, pair.up.reshape(*pair.up.shape, *([1] * (h.dim() - 2)))))
        return
    h = skinny_linear(x, pair.down).mul_(pair.scale)  # the kernel RuntimePath.add_path uses (same rounding)
    _weigh(h, pair, weights, channels_first=False)
    if out.is_contiguous():
        out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), pair.up.t())
    else:
        out.add_(F.linear(h, pair.up))


def _init_linear(
    path: RuntimePath,
    x: torch.Tensor,
    out: torch.Tensor,
    pair: PairFactors | None,
    weights: Weights,
    h: torch.Tensor | None = None,
) -> None:
    """out = bias + (x·Dᵀ·diag(scale) ⊙ weights)·Uᵀ, written in one GEMM (out: a contiguous run,
    uninitialised); `h` given: the weighted x·Dᵀ already formed."""
    bias: torch.Tensor | None = getattr(path.module, "bias", None)  # a plain Linear's: always set
    o2 = out.view(-1, out.shape[-1])
    if pair is None:
        o2.copy_(bias.expand_as(o2)) if bias is not None else o2.zero_()
        return
    if h is None:  # as RuntimePath's fused forward forms it (x flattened first: a strided x rounds otherwise)
        h = (
            skinny_linear(x.reshape(-1, x.shape[-1]), pair.down)
            .mul_(pair.scale)
            .view(*x.shape[:-1], pair.down.shape[0])
        )
        _weigh(h, pair, weights, channels_first=False)
    o2.copy_(
        skinny_linear(h.reshape(-1, h.shape[-1]), pair.up, bias)
    )  # RuntimePath's fused kernels, for exactness


def _weigh(h: torch.Tensor, pair: PairFactors, weights: Weights, channels_first: bool) -> None:
    for start, stop, name in pair.segments:
        w = weights.get(name)
        if w is None or (isinstance(w, float) and w == 1.0):
            continue
        cols = h[:, start:stop] if channels_first else h[..., start:stop]
        cols.mul_(w)


def require_runtime(
    written: Iterable[WrittenLayer], names: Collection[str], error: type[Exception], what: str
) -> None:
    """Refuse adapters merged (or written into quantized storage) anywhere: a merged term cannot vary per row.
    `written`: the layers whose weights hold adapter terms (each with its `adapters`)."""
    hit = [m for m in written if m.adapters & set(names)]
    if hit:
        which = sorted({n for m in hit for n in m.adapters} & set(names))
        raise error(
            f"{what}: adapter(s) {which} are merged into {len(hit)} layers; apply them with mode='runtime'"
        )


def mix_for(
    mix: Mix | None,
    roots: dict[str, torch.nn.Module],
    names: dict[int, str],
    paths: Iterable[RuntimePath],
    settings: Mapping[str, AdapterWeights],
) -> Mix:
    """`mix`, or a new one when None, (re)attached to every runtime path in `paths` (`names`: id(path) ->
    "component.module"; `settings`: the live AdapterWeights by adapter name)."""
    if mix is None:
        mix = Mix(roots, names, settings)
    else:  # paths may have changed (a switch): per-path caches are keyed by id and would be stale
        mix.names = names
        for cache in (mix._pairs, mix._runs, mix._gates):
            cache.clear()
    mix.settings = settings
    for rp in paths:
        rp.mix = mix
    return mix


def release(mix: Mix | None, paths: Iterable[RuntimePath], active: bool) -> Mix | None:
    """Detach `mix` from `paths` once it has neither a batch nor a region (or its adapters are gone): paths
    return to their plain forward. Returns the mix still in use, or None."""
    if mix is not None and (mix.idle or not active):
        for rp in paths:
            rp.mix = None
        mix.remove()
        return None
    return mix


def check_batch(active: bool, exact: object, mix: Mix | None) -> None:
    """Refusals before a per-sample batch opens."""
    if not active:
        raise BatchError("handle was removed")
    if not isinstance(exact, bool):  # a truthy string or array must not silently pick the exact form
        raise BatchError(f"batch(exact=...) must be True or False, got {type(exact).__name__} {exact!r}")
    if mix is not None and mix.keys is not None:
        raise BatchError("a per-sample batch is already open on this handle")
