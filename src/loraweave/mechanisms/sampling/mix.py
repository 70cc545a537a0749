"""Per-sample adapter sets and regional masks in one forward: the terms a RuntimePath adds, computed per run
of rows.

While a handle has a batch or a region, each of its RuntimePaths hands its adapter terms to this object. A
layer's input rows are split into runs of consecutive rows whose samples share one set (rows.py); each run is
a view of the input and of the output, so every set costs its own rank only (a segmented matmul:
x_run·Dₛᵀ·diag(scale)·Uₛᵀ added into the output run in place; no gather, no scatter). Regional adapters scale
their rank columns of h (and their structured terms) by a weight per output token (region.py)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ...errors import BatchError
from ...families.base import ConvSpec
from ..runtime.skinny import skinny_linear
from .persample import PairFactors, SampleKey, pair_for, part_strength_for, row_gates, sample_keys
from .region import token_weights
from .rows import RootProbe, sample_runs

# Below this many (tokens per run x total rank), per-row gating of the whole pair replaces per-run GEMMs.
GATED_MAX_TOKEN_RANKS = 16384


class Mix:
    """The per-sample sets and regions of one handle, and the per-layer caches they need."""

    def __init__(self, roots: dict[str, torch.nn.Module], names: dict[int, str], settings: dict) -> None:
        self.probe = RootProbe(roots)
        self.root_class = {name: type(root).__name__ for name, root in roots.items()}
        self.names = names  # id(path) -> "component.module", for messages
        self.settings = settings  # the handle's AdapterWeights by adapter name (live)
        self.keys: list[SampleKey] | None = None
        self.exact = False  # per-run own-set GEMMs only (no gated short-run form): see `batch`
        self.regions: dict[str, torch.Tensor] = {}
        self._pairs: dict[tuple, PairFactors | None] = {}
        self._runs: dict[tuple, list[tuple[slice, SampleKey]]] = {}
        self._weights: dict[tuple, torch.Tensor | float] = {}
        self._gates: dict[tuple, torch.Tensor] = {}

    def set_batch(self, assignments, strengths, known: dict[str, float], exact: bool = False) -> None:
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

    def _component(self, path) -> str:
        return path.contributions[0][0].component

    def _runs_for(self, path, rows: int) -> list[tuple[slice, SampleKey]]:
        comp = self._component(path)
        call = self.probe.calls.get(comp)
        cache = (comp, call, rows)
        if cache not in self._runs:
            runs: list[tuple[slice, SampleKey]] = []
            for start, stop, sample in sample_runs(
                call, rows, len(self.keys), self.names.get(id(path), "a layer")
            ):
                key = self.keys[sample]
                if runs and runs[-1][1] == key and runs[-1][0].stop == start:
                    runs[-1] = (slice(runs[-1][0].start, stop), key)  # neighbours with one set: one segment
                else:
                    runs.append((slice(start, stop), key))
            self._runs[cache] = runs
        return self._runs[cache]

    def _weights_for(self, path, out: torch.Tensor) -> dict[str, torch.Tensor | float]:
        names = [n for n in self.regions if n in path.adapters]
        if not names:
            return {}
        comp = self._component(path)
        call = self.probe.calls.get(comp)
        found = {}
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

    def _pair(self, path, key: SampleKey | None, out: torch.Tensor) -> PairFactors | None:
        cache = (id(path), key, out.device, out.dtype)
        if (
            key is None
        ):  # the handle's own strengths: the path's cast factors, never cached here (they may change)
            return pair_for(path, None, self.settings, out.device, out.dtype)
        if cache not in self._pairs:
            self._pairs[cache] = pair_for(path, key, self.settings, out.device, out.dtype)
        return self._pairs[cache]

    def add(self, path, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """RuntimePath.add_path while this mix is set: every term, per run of rows and per token."""
        out = output if path.inplace_ok(output) else output.clone()
        self._each(path, x, out, fresh=False)
        return out

    def fused_linear(self, path, x: torch.Tensor) -> torch.Tensor:
        """A plain Linear's forward with each run's low-rank term in the GEMM's accumulator, as the fused path
        does: out[run] = bias + h_run·Uₛᵀ (written once), then out += x·Wᵀ (one pass over the output
        fewer)."""
        out = x.new_empty(*x.shape[:-1], path.out)
        self._each(path, x, out, fresh=True)
        out.view(-1, path.out).addmm_(x.reshape(-1, x.shape[-1]), path.module.weight.t())
        return out

    def _each(self, path, x: torch.Tensor, out: torch.Tensor, fresh: bool) -> None:
        runs = [(slice(None), None)] if self.keys is None else self._runs_for(path, x.shape[0])
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

    def _each_set(self, path, x: torch.Tensor, out: torch.Tensor, runs: list, fresh: bool) -> None:
        """`exact`, several sets: each set's terms over every row, as a lone apply of it computes them (the
        same shapes, so the same CPU kernels: BLAS and oneDNN round by row count), kept on that set's rows
        only. Costs a low-rank pass over all rows per set (the gated form's FLOPs) and one output-sized
        buffer."""
        base = None if fresh else out.clone()
        buffer = out.new_empty(out.shape) if fresh else None
        for key in dict.fromkeys(key for _, key in runs):
            if key == () and not fresh:
                continue  # a sample without adapters: the base output as it is
            buffer = buffer if fresh else base.clone()
            _terms(self, path, x, buffer, key, self._weights_for(path, buffer) if key != () else {}, fresh)
            for rows, mine in runs:
                if mine == key:
                    out[rows] = buffer[rows]

    def _gated(self, path, x: torch.Tensor, out: torch.Tensor, runs: list, fresh: bool) -> bool:
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
        down, up, _ = path.factors_for(out.device, out.dtype)
        h = skinny_linear(x, down)
        h.view(x.shape[0], -1, h.shape[-1]).mul_(self._gates[cache][:, None, :])
        pair = pair_for(path, None, self.settings, out.device, out.dtype)
        _weigh(h, pair, self._weights_for(path, out), channels_first=False)
        if fresh:
            _init_linear(path, x, out, PairFactors(down, up, None, []), {}, h=h)
        else:
            out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), up.t())
        return True


def _put(path, out: torch.Tensor, value: torch.Tensor, dst: int, n: int, alpha: float, weight) -> None:
    """out[rows] += alpha·weight·value in place (weight: per token, per pixel or a number)."""
    if weight is not None and not (isinstance(weight, float) and weight == 1.0):
        value = value * weight
    rows = slice(dst, dst + n)
    (out[:, rows] if path.channels_first else out[..., rows]).add_(value, alpha=alpha)


def _terms(
    mix: Mix,
    path,
    x: torch.Tensor,
    out: torch.Tensor,
    key: SampleKey | None,
    weights: dict,
    fresh: bool = False,
    pair_done: bool = False,
) -> None:
    """Add the set's terms to `out`; `fresh`: `out` is uninitialised and gets bias + low-rank term first (a
    fused plain Linear, whose paths have no terms that read the base output); `pair_done`: the low-rank pair
    is in."""
    strength = lambda pp: part_strength_for(path, pp, key, mix.settings)  # noqa: E731
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


def _add_base_terms(path, x: torch.Tensor, out: torch.Tensor, spec, strength, weights: dict) -> None:
    """The terms that read the layer's base output (without bias): all computed before any is added."""
    base = out
    bias = getattr(path.module, "bias", None)
    if isinstance(bias, torch.Tensor):
        b = bias.to(out.device, out.dtype)
        base = out - (b.view(-1, *([1] * (out.dim() - 2))) if path.channels_first else b)
    found = []
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


def _add_other_terms(path, x: torch.Tensor, out: torch.Tensor, spec, strength, weights: dict) -> None:
    """The dense, function and bias terms (those that read only x), each at its part's strength."""
    for t in path.dense:
        pp, dst, n = t.part, t.dst, t.rows
        s = strength(pp)
        if s != 0.0:
            (d,) = t.cache.to(out.device, out.dtype)
            value = path.conv(x, d, None, **path.conv_args()) if path.conv else F.linear(x, d)
            _put(path, out, value, dst, n, s * pp.scale, weights.get(pp.adapter.name))
    for t in path.fns:
        pp, dst, n, fn = t.part, t.dst, t.rows, t.fn
        s = strength(pp)
        if s != 0.0:
            value, alpha = (fn(x, spec), s * pp.scale) if t.linear else (fn(x, spec, None, s, pp.scale), 1.0)
            _put(path, out, value, dst, n, alpha, weights.get(pp.adapter.name))
    for t in path.biases:
        pp, dst, n = t.part, t.dst, t.rows
        s = strength(pp)
        if s != 0.0:
            (b,) = t.cache.to(out.device, out.dtype)
            b = b.view(-1, *([1] * (out.dim() - 2))) if path.channels_first else b
            _put(path, out, b, dst, n, s * pp.scale, weights.get(pp.adapter.name))


def _add_pair(path, x: torch.Tensor, out: torch.Tensor, pair: PairFactors, weights: dict) -> None:
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
    path,
    x: torch.Tensor,
    out: torch.Tensor,
    pair: PairFactors | None,
    weights: dict,
    h: torch.Tensor | None = None,
) -> None:
    """out = bias + (x·Dᵀ·diag(scale) ⊙ weights)·Uᵀ, written in one GEMM (out: a contiguous run,
    uninitialised); `h` given: the weighted x·Dᵀ already formed."""
    bias, o2 = path.module.bias, out.view(-1, out.shape[-1])
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


def _weigh(h: torch.Tensor, pair: PairFactors, weights: dict, channels_first: bool) -> None:
    for start, stop, name in pair.segments:
        w = weights.get(name)
        if w is None or (isinstance(w, float) and w == 1.0):
            continue
        cols = h[:, start:stop] if channels_first else h[..., start:stop]
        cols.mul_(w)


def require_runtime(written: Iterable, names, error: type[Exception], what: str) -> None:
    """Refuse adapters merged (or written into quantized storage) anywhere: a merged term cannot vary per row.
    `written`: the layers whose weights hold adapter terms (each with its `adapters`)."""
    written = [m for m in written if m.adapters & set(names)]
    if written:
        which = sorted({n for m in written for n in m.adapters} & set(names))
        raise error(
            f"{what}: adapter(s) {which} are merged into {len(written)} layers; apply them with "
            f"mode='runtime'"
        )


def mix_for(
    mix: Mix | None,
    roots: dict[str, torch.nn.Module],
    names: dict[int, str],
    paths: Iterable,
    settings: dict,
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


def release(mix: Mix | None, paths: Iterable, active: bool) -> Mix | None:
    """Detach `mix` from `paths` once it has neither a batch nor a region (or its adapters are gone): paths
    return to their plain forward. Returns the mix still in use, or None."""
    if mix is not None and (mix.idle or not active):
        for rp in paths:
            rp.mix = None
        mix.remove()
        return None
    return mix


def check_batch(active: bool, exact, mix: Mix | None) -> None:
    """Refusals before a per-sample batch opens."""
    if not active:
        raise BatchError("handle was removed")
    if not isinstance(exact, bool):  # a truthy string or array must not silently pick the exact form
        raise BatchError(f"batch(exact=...) must be True or False, got {type(exact).__name__} {exact!r}")
    if mix is not None and mix.keys is not None:
        raise BatchError("a per-sample batch is already open on this handle")
