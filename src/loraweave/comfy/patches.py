"""Merge through ComfyUI's own patch list: `ModelPatcher.add_patches` with a `WeightAdapterBase` subclass
whose `calculate_weight` adds loraweave's exact ΔW (fp32, through loraweave's families) into the rows ComfyUI
hands it.

ComfyUI then owns everything else: backups, lowvram and DynamicVRAM casts, GGUF dequantisation, hooks. A fused
target (Flux `linear1`, `img_attn.qkv`) is patched per row range with an `(key, (0, start, length))` offset,
and ComfyUI narrows the weight before the call, so the adapter writes into that view in place."""

from __future__ import annotations

import functools
import uuid
from collections import defaultdict

import torch

from ..arch.spec import Piece, out_rows
from ..families.contribution import add_contribution, bias_of
from ..report.miss import Miss, Unmatched
from ..report.report import AppliedModule
from ..resolve.planner import Plan, PlannedPart
from .grow import add_notes, grow_patches, grown_inputs
from .host import weight_adapter_base

Term = tuple[PlannedPart, Piece]  # a part and its rows, re-based on the patched slice (dst_start from 0)
PatchKey = str | tuple[str, tuple[int, int, int]]
# ComfyUI's calculate_weight stands in this identity when a patch has no function.
_IDENTITY_QUALNAME = "calculate_weight.<locals>.<lambda>"
NON_LEAF = (
    "object patch: ComfyUI never applies a weight patch to a parameter held by a module with children (Wan "
    "modulation, Lumina x_pad_token), so the patched parameter is set at load and restored at unload"
)


def _is_identity(function) -> bool:
    return function is None or getattr(function, "__qualname__", "") == _IDENTITY_QUALNAME


def unit_delta(pp: PlannedPart, piece: Piece, window: torch.Tensor) -> torch.Tensor:
    """The unscaled ΔW rows of one W-independent part, in `window`'s dtype, formed as ComfyUI core forms them.

    Core adds `weight += (strength * alpha) * torch.mm(up, down)`: the product, then the scale, then the sum,
    each rounded on its own. The families' add_delta fuses the scale into the GEMM (addmm alpha) or the add
    (add_ alpha, an FMA on AVX2/AVX-512 CPUs), whose roundings differ from core's by CPU, so the bits of a
    merge matched core on one CPU and not another. LoRA takes core's very call; the others build ΔW at
    coefficient 1 (exact: 0 + 1·d rounds to d) and are scaled and added the same way."""
    f = pp.factors
    if pp.family.name == "lora":
        rows = f.up[piece.src_start : piece.src_start + piece.length]
        return torch.mm(rows.to(window.dtype), f.down.flatten(1).to(window.dtype))
    if pp.family.set_delta is not None:  # written at coefficient 1 (LoKr: the kron itself), no zero pass
        unit = torch.empty_like(window)
        pp.family.set_delta(unit, f, piece.src_start, piece.length, 1.0)
        return unit
    unit = torch.zeros_like(window)
    pp.family.add(unit, f, piece.src_start, piece.length, 1.0)
    return unit


def _put(window: torch.Tensor, delta: torch.Tensor, add: bool) -> None:
    # A copy into the zeroed buffer of a function patch keeps ΔW's bits (-0.0 too, which 0 + -0.0 would not).
    if add:
        window += delta
    else:
        window.copy_(delta)


def write_rows(rows: torch.Tensor, terms: list[Term], strength: float, function, bias: bool) -> None:
    """rows (the slice ComfyUI narrowed, any dtype) += function(ΔW of `terms` at `strength`), in place.

    Each term's ΔW is formed, scaled and added as core adds one patch (the product, then the scale, then
    `function`, then the sum), so an fp32 slice gets core's bits for every family core is right on. Any other
    dtype (fp16/bf16 under lowvram or DynamicVRAM, or a fp16 merge) accumulates in fp32 and is rounded into
    the slice once: core computes there in that dtype and rounds the product, the scaled ΔW and the sum each
    on its own (up to a few ulps from the fp64 result; ours is the nearest value of the dtype to the fp32
    sum)."""
    flat = rows if bias else rows.reshape(rows.shape[0], -1)
    identity = _is_identity(function)
    acc = flat if flat.dtype == torch.float32 else flat.to(torch.float32, copy=True)
    needs_base = bias or any(pp.family.needs_base for pp, _ in terms)
    base = acc.clone() if needs_base else None
    for pp, piece in terms:
        into = acc if identity else torch.zeros_like(acc)
        window = into[piece.dst_start : piece.dst_start + piece.length]
        if bias:
            delta = bias_of(pp, piece, base)
            if delta is None:
                continue
            _put(window, (strength * pp.strength * pp.scale) * delta.to(acc.dtype), identity)
        elif pp.family.needs_base:
            add_contribution(window, pp, piece, base, strength=strength * pp.strength, scale=pp.scale)
        else:
            delta = unit_delta(
                pp, piece, window
            )  # a fresh tensor: scaled in place, as core scales its product
            _put(window, delta.mul_(strength * pp.strength * pp.scale), identity)
        if not identity:  # core: weight += function(ΔW) with ΔW in the weight's own shape
            acc += function(into.reshape(rows.shape)).reshape(acc.shape)
    if acc is not flat:
        flat.copy_(acc)


@functools.cache
def adapter_class() -> type:
    """The WeightAdapterBase subclass, made on first use (ComfyUI is imported lazily, never by `import
    loraweave`)."""

    class LoraweaveWeightAdapter(weight_adapter_base()):  # type: ignore[misc]  # ComfyUI's class, untyped
        """loraweave's planned parts for one ComfyUI weight (or bias) slice."""

        name = "loraweave"

        def __init__(self, key: str, terms: list[Term], bias: bool) -> None:
            self.key = key
            self.terms = terms
            self.bias = bias
            self.loaded_keys = {k for pp, _ in terms for k in pp.part.keys}
            # no factor list of ComfyUI's kind: the factors live in the planned parts
            self.weights: list[object] = []

        def calculate_weight(
            self,
            weight,
            key,
            strength,
            strength_model,
            offset,
            function,
            intermediate_dtype=torch.float32,
            original_weight=None,
        ):
            # strength_model was applied and the offset narrowed by ComfyUI before this call.
            if strength != 0.0:
                write_rows(weight, self.terms, float(strength), function, self.bias)
            return weight

    return LoraweaveWeightAdapter


def _rows_key(component: str, module: str, piece: Piece, suffix: str) -> PatchKey:
    key = f"{component}.{module}.{suffix}"
    return key if piece.whole else (key, (0, piece.dst_start, piece.length))


Carried = tuple[str, str, list[PlannedPart]]  # component, module, the parts one patch carries


def joined_pieces(pp: PlannedPart, root: torch.nn.Module) -> tuple[Piece, ...]:
    """A W-independent part's pieces with runs that continue on the same module of `root` (a kohya fused `qkv`
    laid out as q, k, v) joined into one, so ComfyUI patches the module once, as core does. needs_base
    families keep their pieces: their ΔW depends on the rows each piece sees."""
    if pp.family.needs_base or len(pp.pieces) < 2:
        return pp.pieces
    out: list[Piece] = []
    for p in sorted(pp.pieces, key=lambda p: (p.module, p.dst_start)):
        last = out[-1] if out else None
        if (
            last is not None
            and last.module == p.module
            and last.src_start + last.length == p.src_start
            and last.dst_start + last.length == p.dst_start
        ):
            n = last.length + p.length
            whole = last.dst_start == 0 and n == out_rows(root.get_submodule(p.module))
            out[-1] = Piece(p.module, last.src_start, last.dst_start, n, whole)
        else:
            out.append(p)
    return tuple(out)


def merge_patches(plan: Plan) -> tuple[dict[PatchKey, object], dict[PatchKey, Carried]]:
    """({patch key: adapter} for add_patches, {patch key: where and what it carries}) of a plan on ComfyUI
    modules."""
    groups: dict[tuple[PatchKey, bool], list[Term]] = defaultdict(list)
    where: dict[PatchKey, tuple[str, str]] = {}
    for pp in plan.planned:
        for piece in joined_pieces(pp, plan.components.modules[pp.component]):
            local = Piece(piece.module, piece.src_start, 0, piece.length, piece.whole)
            for suffix, bias in (("weight", False), ("bias", True)):
                if bias and bias_of(pp, local) is None:
                    continue
                key = _rows_key(pp.component, piece.module, piece, suffix)
                groups[(key, bias)].append((pp, local))
                where[key] = (pp.component, piece.module)
    cls = adapter_class()
    patches: dict[PatchKey, object] = {}
    carried: dict[PatchKey, Carried] = {}
    for (key, bias), terms in groups.items():
        patches[key] = cls(key if isinstance(key, str) else key[0], terms, bias)
        carried[key] = (*where[key], [pp for pp, _ in terms])
    return patches, carried


def param_patches(plan: Plan) -> tuple[dict[str, tuple], dict[str, torch.Tensor]]:
    """("diff", ΔP) patches of bare parameters (full-difference keys on modulation tables), and the ΔP of
    those ComfyUI would accept but never apply (held by a module with children): those go in as object
    patches."""
    patches: dict[str, tuple] = {}
    objects: dict[str, torch.Tensor] = {}
    modules = {name: dict(m.named_modules()) for name, m in plan.components}
    for param in plan.params:
        owner = modules[param.component].get(param.owner)
        delta = param.delta.to(torch.float32) * (param.strength * param.scale)
        key = f"{param.component}.{param.path}"
        if owner is not None and any(True for _ in owner.children()):
            objects[key] = objects[key] + delta if key in objects else delta
        else:
            patches[key] = ("diff", (delta,))
    return patches, objects


def _object_patch(clone, key: str, delta: torch.Tensor, strength: float) -> None:
    # Stacks on an earlier object patch of the same parameter (two loaders in a chain).
    current = clone.get_model_object(key).detach()
    value = (current.to(torch.float32) + strength * delta.to(current.device)).to(current.dtype)
    clone.add_object_patch(key, torch.nn.Parameter(value, requires_grad=False))
    clone.patches_uuid = uuid.uuid4()  # add_object_patch alone would not make a loaded model re-patch


def add_to_clone(patcher, plan: Plan, strength: float) -> tuple[object, list[AppliedModule], list[Unmatched]]:
    """A clone of `patcher` with the plan's patches added at `strength` (the input is untouched), the report
    rows of what ComfyUI accepted, and the misses of what it refused."""
    grown = grown_inputs(plan)  # a control adapter's input, at the width the engine allowed
    patches, carried = merge_patches(plan)
    params, objects = param_patches(plan)
    misses: list[Unmatched] = []
    clone = patcher.clone()
    if strength == 0.0:  # as ComfyUI's loader: a zero strength adds nothing
        return clone, [], misses
    if grown:  # control adapters: the wider input first, then their ΔW
        clone.add_patches(grow_patches(grown))
    every: dict[PatchKey, object] = {**patches}
    every.update(params.items())
    accepted = set(clone.add_patches(every, strength))
    for param_key, delta in objects.items():
        _object_patch(clone, param_key, delta, strength)
    accepted |= set(objects)
    applied: dict[tuple[str, str], set[str]] = {}
    for key, (component, module, parts) in carried.items():
        if key not in accepted:
            name = key if isinstance(key, str) else key[0]
            refused = Miss("no_such_module", f"ComfyUI refused the patch key {name}")
            misses += [Unmatched(pp.adapter.name, k, refused) for pp in parts for k in pp.part.keys]
            continue
        applied.setdefault((component, module), set()).update(pp.adapter.name for pp in parts)
    for param in plan.params:
        if f"{param.component}.{param.path}" in accepted:
            applied.setdefault((param.component, param.path), set()).add(param.adapter.name)
    rows = [
        AppliedModule(c, m, "merge", sorted(names), notes=[NON_LEAF] if f"{c}.{m}" in objects else [])
        for (c, m), names in sorted(applied.items())
    ]
    add_notes(rows, grown)
    return clone, rows, misses
