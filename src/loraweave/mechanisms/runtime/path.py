"""Runtime: weights untouched; a forward hook adds every adapter's path as one rank-concatenated pair."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle

from ...arch.spec import out_rows
from ...families.base import CastCache, ConvSpec, RuntimeTerm
from ...resolve.planner import PlannedPart
from ...resolve.stacking import Contribution
from .host import (
    NORMS_CHANNELS_FIRST,
    CachedRows,
    DequantizedView,
    FnRows,
    Pair,
    RankSpan,
    conv_fn,
    host_bias,
    kernel_dims,
    rebound,
    runtime_host,
)
from .pair import concatenated
from .skinny import probe, skinny_linear


class PathMix(Protocol):
    """What computes a path's adapter terms while per-sample sets or regions are set
    (mechanisms/sampling/mix.py Mix)."""

    def add(self, path: RuntimePath, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor: ...

    def fused_linear(self, path: RuntimePath, x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor: ...


class RuntimePath:
    """All adapters on one layer: y += B·diag(s)·A(x) (+ dense full diffs and bias deltas)."""

    def __init__(
        self, module: torch.nn.Module, contributions: list[Contribution], borrow: bool | None = None
    ) -> None:
        """`borrow`: the factors' memory is owned by their adapters and never written (formats' `read=True`):
        a pair that needs no concatenation is kept as it is instead of copied. None: whether every
        contributing adapter's source owns its memory (a mapped file may be saved over while applied:
        copied)."""
        if borrow is None:
            borrow = all(getattr(pp.adapter.source, "owned", False) for pp, _ in contributions)
        self.module = module
        self.contributions = list(contributions)  # kept so a switch can compare and re-point them
        self.conv = conv_fn(module)
        self.channels_first = self.conv is not None or isinstance(module, NORMS_CHANNELS_FIRST)
        self.out: int = out_rows(module) or 0  # 0: no weight shape (an affine-free norm: fn terms only)
        self.owners: list[RankSpan] = []
        self.dense: list[CachedRows] = []
        self.biases: list[CachedRows] = []
        self.fns: list[FnRows] = []
        self.base_fns: list[FnRows] = []  # those read the base output (without bias)
        self.fn_caches: list[CastCache] = []  # what the structured terms read (RuntimeTerm.caches)
        self.adapters: set[str] = set()
        self.costs: set[str] = set()  # reported per layer: what the runtime form costs beyond a low-rank pair
        pairs = self._gather(contributions)
        self.gates: dict[str, float] = {}  # per-adapter factor on this layer only (1 when absent)
        # the rank-concatenated pair: down (R, in, *k) and up (out, R), stored dtype (promoted by cat); kept
        # across strength changes. The scale vector is rewritten in place by refresh_scales, never rebuilt.
        pair = concatenated(pairs, self.out, borrow) if pairs else None
        self._factor_cast = CastCache(*pair) if pair else None
        self._scale_cast = CastCache(torch.empty(pair[0].shape[0] if pair else 0))
        self.refresh_scales()
        self.hook: RemovableHandle | None = None
        self.active = False
        self._linear: torch.nn.Linear  # the host, set by attach before it installs the fused forward
        # per-sample sets / regions (mechanisms/sampling/mix.py): while set, it computes the adapter terms
        self.mix: PathMix | None = None

    def _gather(self, contributions: list[Contribution]) -> list[Pair]:
        """Sort every contribution's runtime term into the records the forward reads (built once, here)."""
        pairs: list[Pair] = []
        host = None  # built on first need: only families that read W look at it
        for pp, piece in contributions:
            if pp.family.reads_host and host is None:
                host = runtime_host(self.module)
            term = pp.family.term(pp.factors, piece.src_start, piece.dst_start, piece.length, host)
            self._note_costs(pp, term, isinstance(host, DequantizedView))
            self.adapters.add(pp.adapter.name)
            if term.down is not None:
                self._add_pair(pp, term, pairs)
            if term.dense is not None:
                self.dense.append(CachedRows(pp, term.dst_start, term.length, CastCache(term.dense)))
            if term.fn is not None:
                self._add_fn(pp, term, term.fn)
            if term.bias is not None:
                self.biases.append(CachedRows(pp, term.dst_start, term.length, CastCache(term.bias)))
        return pairs

    def _note_costs(self, pp: PlannedPart, term: RuntimeTerm, dequantized_host: bool) -> None:
        if term.cost:
            self.costs.add(f"{pp.part.family}: {term.cost}")
        if pp.family.reads_host and dequantized_host and term.fn is not None and term.needs_base:
            self.costs.add(
                f"{pp.part.family}: reads W dequantized from the quantized storage when it needs it"
            )

    def _add_pair(self, pp: PlannedPart, term: RuntimeTerm, pairs: list[Pair]) -> None:
        assert term.down is not None and term.up is not None
        if pairs and self.owners[-1].part is pp and term.down is pairs[-1][1][0].down:
            # Another row chunk of the same part (split or per-head interleaved fused keys): one pair, not
            # one pair per chunk (DiffSynth's H3 QKV would otherwise hold its down once per head).
            pairs[-1][1].append(term)
            return
        rank = term.down.shape[0]
        down = term.down.reshape(rank, *kernel_dims(self.module)) if self.conv else term.down.flatten(1)
        pairs.append((down, [term]))
        self.owners.append(RankSpan(pp, term.up.shape[1]))

    def _add_fn(self, pp: PlannedPart, term: RuntimeTerm, fn: Callable[..., torch.Tensor]) -> None:
        if not (term.caches or term.unheld):
            raise TypeError(f"{pp.part.family}: a runtime term with fn declares neither caches nor unheld")
        if term.unheld:
            self.costs.add(f"{pp.part.family}: {term.unheld} (held by the path, not by a host)")
        self.fn_caches.extend(term.caches)
        target = self.base_fns if term.needs_base else self.fns
        target.append(FnRows(pp, term.dst_start, term.length, fn, term.linear_in_strength))

    @property
    def down(self) -> torch.Tensor | None:
        """The pair's down master (the object the casts read: a holder may have re-pointed it)."""
        return self._factor_cast.tensors[0] if self._factor_cast is not None else None

    @property
    def up(self) -> torch.Tensor | None:
        return self._factor_cast.tensors[1] if self._factor_cast is not None else None

    @property
    def scale(self) -> torch.Tensor:
        """Per-rank scales (strength · gate · part scale), written in place on a strength change."""
        return self._scale_cast.tensors[0]

    def strength_of(self, pp: PlannedPart) -> float:
        return pp.strength * self.gates.get(pp.adapter.name, 1.0)

    def set_gate(self, name: str, value: float) -> None:
        """Scale one adapter on this layer only (select modes; switching gates dropped adapters to 0)."""
        self.gates[name] = float(value)
        self.refresh_scales()

    def vanishes_at_zero(self, name: str) -> bool:
        """Whether adapter `name`'s terms here are all zero at strength 0, so gating it equals removing it
        (DoRA's magnitude, OFT's rescale are not: those layers are rebuilt without it)."""
        return all(t.linear for t in (*self.fns, *self.base_fns) if t.part.adapter.name == name)

    def rebound_copy(self, mapping: dict[int, PlannedPart]) -> RuntimePath:
        """A copy sharing this path's factor tensors, with its own scales, casts and no hook, bound to
        `mapping` (a re-queue at another strength: the copy's scale vector holds the new strengths)."""
        path = copy.copy(self)
        path.gates, path.hook, path.active, path.mix = dict(self.gates), None, False, None
        down, up = self.down, self.up
        path._factor_cast = CastCache(down, up) if down is not None and up is not None else None
        path._scale_cast = CastCache(self.scale.clone())
        path.dense = [dataclasses.replace(e, cache=CastCache(*e.cache.tensors)) for e in self.dense]
        path.biases = [dataclasses.replace(e, cache=CastCache(*e.cache.tensors)) for e in self.biases]
        path.rebind(mapping)
        return path

    def rebind(self, mapping: dict[int, PlannedPart]) -> None:
        """Point contributions at new planned parts of identical structure (a switch): strengths follow
        them."""
        self.owners = rebound(self.owners, mapping)
        self.contributions = [
            Contribution(mapping.get(id(pp), pp), piece) for pp, piece in self.contributions
        ]
        self.dense, self.biases = rebound(self.dense, mapping), rebound(self.biases, mapping)
        self.fns, self.base_fns = rebound(self.fns, mapping), rebound(self.base_fns, mapping)
        records: list[RankSpan | CachedRows | FnRows] = [
            *self.owners,
            *self.dense,
            *self.biases,
            *self.fns,
            *self.base_fns,
        ]
        self.adapters = {t.part.adapter.name for t in records}
        self.refresh_scales()

    def refresh_scales(self) -> None:
        """Recompute the per-rank scale vector from current strengths: no factor is rebuilt."""
        start = 0
        for span in self.owners:
            pp = span.part
            self.scale[start : start + span.rank] = self.strength_of(pp) * pp.scale
            start += span.rank
        self._scale_cast.refresh()  # only the scale vector's device copy is rewritten after a strength change

    def factors_for(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(down, up, scale) on (device, dtype); (scale,) alone when the layer has no low-rank pair."""
        pair = self._factor_cast.to(device, dtype) if self._factor_cast is not None else ()
        return (*pair, *self._scale_cast.to(device, dtype))

    def caches(self) -> list[CastCache]:
        """Every cache this path reads adapter tensors through: the rank-concatenated pair, the scale vector,
        dense diffs, bias deltas and what structured terms declare (RuntimeTerm.caches). A host that counts
        and moves the adapter (ComfyUI's model management) holds their sources and re-points each cache after
        a move (CastCache.repoint): the path then reads the moved tensors, casts follow, nothing is
        rebuilt."""
        own = [c for c in (self._factor_cast, self._scale_cast) if c is not None]
        return [*own, *(t.cache for t in self.dense), *(t.cache for t in self.biases), *self.fn_caches]

    def held_tensors(self) -> list[torch.Tensor]:
        """The sources of every cache (`caches`), each object once."""
        return list({id(t): t for c in self.caches() for t in c.tensors}.values())

    def bind_factors(
        self, device: torch.device, dtype: torch.dtype, down: torch.Tensor, up: torch.Tensor
    ) -> None:
        """Compute with `down`/`up` already on (device, dtype), e.g. a streamed block's slot views: no cast
        made."""
        if self._factor_cast is not None:
            self._factor_cast.put(device, dtype, (down, up))

    def pad_rank(self, rank: int) -> None:
        """Zero-pad the rank-concatenated pair to `rank` (torch.compile buckets): the same product, fixed
        shapes."""
        down, up = self.down, self.up
        if down is None or up is None or rank <= down.shape[0]:
            return
        extra = rank - down.shape[0]
        down = torch.cat([down, down.new_zeros(extra, *down.shape[1:])])
        up = torch.cat([up, up.new_zeros(up.shape[0], extra)], dim=1)
        # the padded tail of the scales stays 0: refresh_scales writes only the real ranks
        self._factor_cast, self._scale_cast = CastCache(down, up), CastCache(torch.zeros(rank))
        self.refresh_scales()

    def unbind_factors(self) -> None:
        """Forget any device copy of the factors (the next forward casts again)."""
        if self._factor_cast is not None:
            self._factor_cast.clear()

    def warm(self) -> None:
        weight = getattr(self.module, "weight", None)
        if self.down is not None and isinstance(weight, torch.Tensor) and weight.is_floating_point():
            if weight.device.type != "meta":
                self.factors_for(weight.device, weight.dtype)
            if weight.device.type == "cpu" and weight.dtype == torch.float32:
                probe()  # now, so a later torch.compile trace can use the oneDNN kernels (skinny.py)

    def conv_args(self) -> dict[str, Any]:
        m = self.module
        return {"stride": m.stride, "padding": m.padding, "dilation": m.dilation}

    def __call__(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Forward hook: add every adapter's path to the layer's output."""
        x = args[0] if args else next(iter(kwargs.values()))
        if not isinstance(output, torch.Tensor):
            return output
        # Offload hooks (accelerate) move inputs inside forward; the hook sees them before, so follow the
        # output.
        if x.device != output.device or (x.dtype != output.dtype and x.is_floating_point()):
            x = x.to(output.device, output.dtype)
        return self.add_path(x, output)

    def _base_terms(
        self, x: torch.Tensor, output: torch.Tensor
    ) -> list[tuple[torch.Tensor, int, int, float]]:
        """Deltas of W-dependent families, computed from the untouched base output (without bias)."""
        if not self.base_fns:
            return []
        base = output
        bias = host_bias(self.module)
        if bias is not None:
            b = bias.to(output.device, output.dtype)
            base = output - (b.view(-1, *([1] * (output.dim() - 2))) if self.channels_first else b)
        spec = ConvSpec(self.conv, self.conv_args()) if self.conv else None
        out: list[tuple[torch.Tensor, int, int, float]] = []
        for t in self.base_fns:
            pp, dst, n, fn = t.part, t.dst, t.rows, t.fn
            rows = base[:, dst : dst + n] if self.channels_first else base[..., dst : dst + n]
            s = self.strength_of(pp)
            value, alpha = (
                (fn(x, spec, rows), s * pp.scale) if t.linear else (fn(x, spec, rows, s, pp.scale), 1.0)
            )
            out.append((value, dst, n, alpha))
        return out

    def _fused_linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Plain nn.Linear forward with the low-rank path in the GEMM's accumulator: y = (b + s·B·A·x) + W·x.

        One pass over the output fewer than base-then-add; the two thin GEMMs on oneDNN where it applies
        (mechanisms/runtime/skinny.py). At r=16, 3072², 4096 tokens (bench_floor.py) 0.33x the FLOP floor over
        a 91 GF/s sgemm, 2.05-2.76x over a 160 GF/s one: the thin GEMMs cost the same milliseconds on
        either."""
        m = self._linear
        w = m.weight
        plain = (
            not self.active
            or x.dtype != w.dtype
            or x.device != w.device
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))
        )
        if plain:
            out = F.linear(x, w, m.bias)
            return self.add_path(x, out) if self.active else out
        if self.mix is not None:
            return self.mix.fused_linear(self, x, m)
        down, up, scale = self.factors_for(w.device, w.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        h = skinny_linear(x2, down).mul_(scale)
        y = skinny_linear(h, up, m.bias)
        y.addmm_(x2, w.t())
        return self._add_extras(x, y.view(*x.shape[:-1], self.out))

    def add_path(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        if self.mix is not None:
            return self.mix.add(self, x, output)
        dtype = output.dtype
        base_terms = self._base_terms(x, output)  # before anything is added to the output
        for value, dst, n, alpha in base_terms:
            output = self._add_rows(output, value, dst, n, alpha)
        if self.down is not None:
            down, up, scale = self.factors_for(output.device, dtype)
            if self.conv:
                h = self.conv(x, down, None, **self.conv_args())
                h = h * scale.view(1, -1, *([1] * (h.dim() - 2)))
                delta = self.conv(h, up.view(*up.shape, *([1] * (h.dim() - 2))))
                output = output.add_(delta) if self.inplace_ok(output) else output + delta
            else:
                h = skinny_linear(x, down).mul_(scale)
                if self.inplace_ok(output) and output.is_contiguous():
                    output.view(-1, self.out).addmm_(h.view(-1, h.shape[-1]), up.t())
                else:
                    output = output + F.linear(h, up)
        return self._add_extras(x, output)

    def _add_extras(self, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """Dense full diffs and bias deltas (rare; not part of the rank-concatenated pair)."""
        dtype = output.dtype
        for t in self.dense:
            (d,) = t.cache.to(output.device, dtype)
            part = self.conv(x, d, None, **self.conv_args()) if self.conv else F.linear(x, d)
            output = self._add_rows(output, part, t.dst, t.rows, self.strength_of(t.part) * t.part.scale)
        spec = ConvSpec(self.conv, self.conv_args()) if self.conv else None
        for f in self.fns:
            pp = f.part
            if f.linear:
                output = self._add_rows(output, f.fn(x, spec), f.dst, f.rows, self.strength_of(pp) * pp.scale)
            else:
                value = f.fn(x, spec, None, self.strength_of(pp), pp.scale)
                output = self._add_rows(output, value, f.dst, f.rows)
        for t in self.biases:
            b = t.cache.to(output.device, dtype)[0] * (self.strength_of(t.part) * t.part.scale)
            if self.channels_first:
                b = b.view(-1, *([1] * (output.dim() - 2)))
            output = self._add_rows(output, b, t.dst, t.rows)
        return output

    def inplace_ok(self, output: torch.Tensor) -> bool:
        return not (torch.is_grad_enabled() and output.requires_grad)

    def _add_rows(
        self, output: torch.Tensor, value: torch.Tensor, dst: int, n: int, alpha: float = 1.0
    ) -> torch.Tensor:
        """output[rows] += alpha·value, in place when autograd allows (no output-sized temporary)."""
        out = output if self.inplace_ok(output) else output.clone()
        rows = slice(dst, dst + n)
        (out[:, rows] if self.channels_first else out[..., rows]).add_(value, alpha=alpha)
        return out

    def _fusable(self) -> torch.nn.Linear | None:
        """The host when its forward can be replaced by the fused one (a plain nn.Linear), else None."""
        m = self.module
        weight = getattr(m, "weight", None)
        if type(m) is not torch.nn.Linear:
            return None
        fits = (
            self.down is not None
            and not self.base_fns  # those need the base output on its own
            and "forward" not in m.__dict__  # someone else already replaced forward: stay out of their way
            and getattr(m, "_hf_hook", None) is None
            and isinstance(weight, torch.Tensor)
            and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.device.type != "meta"
        )
        return m if fits else None

    def attach(self) -> None:
        self.warm()
        self.active = True
        linear = self._fusable()
        if linear is not None:
            self._linear = linear
            self.module.forward = self._fused_linear_forward
        else:
            # First in line, so every observer hook sees the layer's output with the adapters, as when fused.
            self.hook = self.module.register_forward_hook(self, with_kwargs=True, prepend=True)

    def undo(self) -> None:  # a journal entry
        self.detach()

    def detach(self) -> None:
        self.active = False  # a wrapper installed over our forward later now passes straight through
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.module.__dict__.get("forward") == self._fused_linear_forward:
            del self.module.forward
        self.unbind_factors()  # no device copy outlives the hook (a re-attach casts again)
        self._scale_cast.clear()
