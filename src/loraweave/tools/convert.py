"""`convert`: rewrite an adapter in another trainer layout (kohya, peft, diffusers, comfy) without changing
what it does. Every part is resolved against the model (full size on `meta`, or a given module) into row
ranges of live modules, then regrouped under the names the target layout uses: fused rows are split (shared
down, up rows cut) or joined (shared down when equal, else rank concatenation), alpha is carried so γ =
alpha/rank is unchanged. The output is re-resolved before it is written; a key that would not land aborts the
conversion."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..arguments import positive_int
from ..errors import ArgumentError, ConvertError, EmptyOutputError
from ..formats.adapter import load_adapter
from ..io.output import check_output
from ..io.write import save_file
from ..progress import bar
from ..resolve.planner import PlannedPart, resolve
from .convert_parts import (
    AS_IS_LAYOUTS,
    KOHYA_NAMED,
    LYCORIS_AS_IS,
    alpha_metadata,
    as_is_tensors,
    carried_metadata,
    self_check,
    svd_pair,
    take_embeddings,
    write_peft,
)
from .layout_names import Pair, target_components, target_spans, target_stem

log = logging.getLogger("loraweave")
LAYOUTS = ("kohya", "peft", "diffusers", "comfy")


@dataclass
class TargetPiece:
    """Rows [row, row+length) of a target name receive up_rows @ down, scaled by alpha/rank."""

    row: int
    length: int
    down: torch.Tensor  # (r, in, *k)
    up: torch.Tensor  # (length, r)
    alpha: float
    pp: PlannedPart


Groups = dict[tuple[str, str], tuple[int, list[TargetPiece]]]  # (component, target name): (rows, pieces)


@dataclass
class ConvertResult:
    output: Path
    layout: str
    keys_in: int = 0
    keys_out: int = 0
    targets: int = 0
    splits: int = 0
    joins: int = 0
    notes: list[str] = field(default_factory=list)
    dropped_embeddings: list[str] = field(default_factory=list)  # textual-inversion tokens left out
    metadata_kept: int = 0  # the source's metadata fields carried over unchanged
    metadata_rewritten: dict[str, str] = field(default_factory=dict)  # field -> why it was rewritten/dropped
    as_is: int = 0  # LoKr/LoHa parts written in their own family under the layout's names
    lowrank: list[dict] = field(default_factory=list)  # {name, family, rank, energy}: parts made LoRAs
    written: set[tuple[int, float]] = field(default_factory=set, repr=False)  # (rank, alpha) per module

    def to_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k != "written"}
        energies = [la["energy"] for la in self.lowrank]
        return {**out, "output": str(self.output), "energy_min": min(energies, default=None)}


def _alpha(pp: PlannedPart, rank: int) -> float:
    """The alpha to write so alpha/rank == γ: the file's own number when it had one (no rounding)."""
    a, meta = pp.adapter, pp.adapter.meta_alpha
    if pp.alpha_source == "tensor:alpha":
        return float(a.tensor(pp.part.roles["alpha"]).float())
    if pp.alpha_source == "metadata:ss_network_alpha" and meta.kohya_alpha is not None:
        return meta.kohya_alpha
    if pp.alpha_source == "metadata:conv_alpha" and meta.kohya_conv_alpha is not None:
        return meta.kohya_conv_alpha
    if pp.alpha_source == "default:1":
        return float(rank)
    return pp.scale * rank


class PairOf(Protocol):
    """The LoRA factors a planned part is written with (its own, or a low-rank form of another family)."""

    def __call__(self, pp: PlannedPart) -> Pair: ...


def lora_pair(pp: PlannedPart) -> Pair:
    """A LoRA part's own factors and the alpha that keeps its γ."""
    f = pp.factors
    return f.down, f.up, _alpha(pp, f.rank)


def regroup(plan, layout: str, pair_of: PairOf = lora_pair, skip=frozenset()) -> Groups:
    """{(component, target name): (rows, pieces)} for every part of the plan but those in `skip` (ids)."""
    groups: Groups = {}
    pairs: dict[int, Pair] = {}
    for span in target_spans(plan, layout):
        pp = span.pp
        if id(pp) in skip:
            continue
        if id(pp) not in pairs:
            pairs[id(pp)] = pair_of(pp)
        down, full_up, alpha = pairs[id(pp)]
        up = full_up[span.src : span.src + span.length]
        up_bias = getattr(pp.factors, "up_bias", None)
        if not bool(up.any()) and (
            up_bias is None or not bool(up_bias[span.src : span.src + span.length].any())
        ):
            # rows this part leaves untouched (a zero block of a joined LoRA): nothing to write
            continue
        entry = groups.setdefault((span.component, span.name), (span.total, []))
        entry[1].append(TargetPiece(span.row, span.length, down, up, alpha, pp))
    return groups


def _prune(down: torch.Tensor, up: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Drop rank columns whose up column is all zero (the other rows' share after a split); γ is kept."""
    keep = up.flatten(1).ne(0).any(0)
    if bool(keep.all()) or not bool(keep.any()):
        return down, up, alpha
    rank = down.shape[0]
    return down[keep], up[:, keep], alpha / rank * int(keep.sum())


Assembled = tuple[torch.Tensor, torch.Tensor, float]  # (down, up, alpha) of one target module


def _assemble(rows: int, pieces: list[TargetPiece], result: ConvertResult) -> Assembled:
    """One (down, up, alpha) for a target of `rows` rows from its pieces."""
    first = pieces[0]
    shared = all(
        p.down.shape == first.down.shape
        and (p.down is first.down or torch.equal(p.down, first.down))
        and p.alpha == first.alpha
        for p in pieces
    )
    if shared:  # one down for all rows: a plain split or a join of a shared-down fused LoRA
        return _assemble_shared(rows, pieces, result)
    return _assemble_stacked(rows, pieces, result)


def _assemble_shared(rows: int, pieces: list[TargetPiece], result: ConvertResult) -> Assembled:
    """Pieces with one down and alpha: their up rows placed in one up (ranks never used by any row pruned)."""
    first = pieces[0]
    up = first.up.new_zeros(rows, first.down.shape[0])
    for p in pieces:
        up[p.row : p.row + p.length] = p.up
    if len({id(p.pp) for p in pieces}) > 1:
        result.joins += 1
    elif sum(p.length for p in pieces) != first.pp.factors.rows:
        result.splits += 1
    return _prune(first.down, up, first.alpha)


def _assemble_stacked(rows: int, pieces: list[TargetPiece], result: ConvertResult) -> Assembled:
    """Pieces with their own downs: ranks stacked, each piece's up in its own columns (block diagonal)."""
    first = pieces[0]
    result.joins += 1
    gammas = {p.alpha / p.down.shape[0] for p in pieces}
    total_rank = sum(p.down.shape[0] for p in pieces)
    up = first.up.new_zeros(rows, total_rank)
    col = 0
    for p in pieces:
        r = p.down.shape[0]
        block = p.up if len(gammas) == 1 else (p.up.float() * (p.alpha / r)).to(p.up.dtype)
        up[p.row : p.row + p.length, col : col + r] = block
        col += r
    if len(gammas) != 1:
        result.notes.append("joined parts with different alpha/rank: scales folded into up (one rounding)")
    down = torch.cat([p.down.to(first.down.dtype) for p in pieces])
    return down, up, (gammas.pop() * total_rank) if len(gammas) == 1 else float(total_rank)


def _refuse_unconvertible(plan, to: str, rank: int | None) -> None:
    """Refuse keys that resolve to no target name, parts of families other than LoRA, LoKr and LoHa (LoKr and
    LoHa as they are only where the layout names their factors), and a LoRA bias the layout cannot hold."""
    if plan.unmatched:
        reasons = sorted({u["reason"] for u in plan.unmatched})[:5]
        raise ConvertError(
            f"{len(plan.unmatched)} keys do not resolve against the model, so their target names are "
            f"unknown: {'; '.join(reasons)}"
        )
    families = {pp.part.family for pp in plan.planned}
    other = sorted(families - {"lora", *LYCORIS_AS_IS})
    if other:
        raise ConvertError(
            "convert handles the LoRA, LoKr and LoHa families; this file also holds "
            f"{', '.join(other)} parts (their factor layouts differ per trainer, so no lossless rename is "
            "offered)"
        )
    lycoris = sorted(families & set(LYCORIS_AS_IS))
    if lycoris and rank is None and to not in AS_IS_LAYOUTS:
        raise ConvertError(
            f"{', '.join(lycoris)} parts keep their family only in the "
            f"{' and '.join(AS_IS_LAYOUTS)} layouts; "
            f"pass --rank R to write them as LoRAs in the {to} layout (truncated SVD, energy reported)"
        )
    if any(getattr(pp.factors, "up_bias", None) is not None for pp in plan.planned) and to in KOHYA_NAMED:
        raise ConvertError(f"{to} layout has no LoRA bias (lora_B.bias) keys")


def module_tensors(
    to: str, stem: str, down: torch.Tensor, up: torch.Tensor, alpha: float, rows: int, pieces
) -> dict[str, torch.Tensor]:
    """One module's keys in layout `to`: down, up (shaped as down's kernel), kohya's alpha, the LoRA bias."""
    up = up.reshape(up.shape[0], down.shape[0], *([1] * (down.dim() - 2)))
    if to in KOHYA_NAMED:
        out = {
            stem + ".lora_down.weight": down.contiguous(),
            stem + ".lora_up.weight": up.contiguous(),
            stem + ".alpha": torch.tensor(alpha, dtype=torch.float32),
        }
    else:
        out = {stem + ".lora_A.weight": down.contiguous(), stem + ".lora_B.weight": up.contiguous()}
    biases = [(p, getattr(p.pp.factors, "up_bias", None)) for p in pieces]
    bias = [(p.row, p.length, ub) for p, ub in biases if ub is not None]
    if bias:
        b = up.new_zeros(rows)
        for row, length, ub in bias:
            b[row : row + length] = ub[:length]
        out[stem + ".lora_B.bias"] = b
    return out


def convert(
    path,
    to: str,
    output: str | os.PathLike,
    target=None,
    arch: str | None = None,
    model: str | None = None,
    overwrite: bool = False,
    allow_empty: bool = False,
    progress: bool = False,
    allow_pickle: bool = False,
    drop_embeddings: bool = False,
    rank: int | None = None,
) -> ConvertResult:
    """Write the adapter at `path` in layout `to`; `target` (module / mapping) overrides `arch` / `model`.

    LoKr and LoHa parts keep their family in the kohya and comfy layouts; with `rank` they become LoRAs of
    rank <= `rank` (truncated SVD of each part's ΔW, captured energy in `result.lowrank`). The source's
    metadata is carried over; what the conversion changes is rewritten or dropped (`metadata_rewritten`).

    An adapter with no key is refused (EmptyOutputError, nothing written) unless `allow_empty`.
    Textual-inversion tokens, which no adapter layout carries, are refused (ConvertError) unless
    `drop_embeddings` leaves them out; the result names them."""
    if to not in LAYOUTS:
        raise ArgumentError(f"--to must be one of {LAYOUTS}")
    if rank is not None:
        positive_int(rank, "rank")
    inputs = [path] if isinstance(path, (str, os.PathLike)) else []
    out = check_output(output, inputs, overwrite=overwrite, folder=to == "peft")
    adapter = load_adapter(path, allow_pickle=allow_pickle)
    dropped = take_embeddings(adapter, path if inputs else adapter.name, drop_embeddings)
    if not adapter.keys_total and not allow_empty:
        raise EmptyOutputError(
            f"{path}: the adapter holds no key; the output would be empty; nothing written "
            "(--allow-empty writes it anyway)"
        )
    components = target_components(adapter, target, arch, model)
    plan = resolve(components, [(adapter, 1.0)])
    _refuse_unconvertible(plan, to, rank)
    result = ConvertResult(out, to, keys_in=adapter.keys_total, dropped_embeddings=dropped)
    if dropped:
        result.notes.append(f"dropped textual-inversion token embeddings: {', '.join(dropped)}")
    source = path if inputs else adapter.name
    tensors, patterns = _write_parts(plan, to, rank, result, source, progress)
    metadata, config = alpha_metadata(to, patterns, components)
    carried, result.metadata_rewritten = carried_metadata(
        adapter.metadata, _ranks_changed(plan, result), bool(result.lowrank)
    )
    metadata = {**carried, **metadata}
    result.metadata_kept = len(carried)
    result.notes = sorted(set(result.notes))
    self_check(tensors, metadata, config, components, out, plan)
    result.keys_out = len(tensors)
    if to == "peft":
        write_peft(tensors, config, out, inputs, overwrite, metadata)
    else:
        save_file(tensors, out, metadata, inputs=inputs, overwrite=overwrite)
    log.info(
        "convert to=%s output=%s keys_in=%d keys_out=%d splits=%d joins=%d",
        to,
        out,
        result.keys_in,
        result.keys_out,
        result.splits,
        result.joins,
    )
    return result


def _write_parts(plan, to: str, rank: int | None, result: ConvertResult, source: object, progress: bool):
    """(every output tensor, {component: {target name: (rank, alpha)}} for the PEFT config)."""
    components = plan.components
    spans = target_spans(plan, to)
    as_is = [] if rank is not None else [pp for pp in plan.planned if pp.part.family != "lora"]
    tensors: dict[str, torch.Tensor] = {}
    for pp in as_is:
        span = next(s for s in spans if s.pp is pp)
        denoiser = span.component == components.denoiser_name
        stem = target_stem(to, span.component, span.name, denoiser, components, source=source)
        tensors.update(as_is_tensors(spans, pp, stem))
        result.as_is += 1
        result.targets += 1

    def pair_of(pp: PlannedPart) -> Pair:
        if pp.part.family == "lora":
            return lora_pair(pp)
        pair, captured = svd_pair(plan, pp, pp.scale, rank)
        result.lowrank.append(
            {"name": pp.part.stem, "family": pp.part.family, "rank": pair[0].shape[0], "energy": captured}
        )
        return pair

    patterns: dict[str, dict] = {}
    groups = regroup(plan, to, pair_of, skip={id(pp) for pp in as_is})
    for (comp, name), (rows, pieces) in bar(
        groups.items(), total=len(groups), desc="convert", unit="module", enabled=progress
    ):
        down, up, alpha = _assemble(rows, pieces, result)
        stem = target_stem(to, comp, name, comp == components.denoiser_name, components, source=source)
        tensors.update(module_tensors(to, stem, down, up, alpha, rows, pieces))
        if to not in KOHYA_NAMED:
            patterns.setdefault(comp, {})[name] = (down.shape[0], alpha)
        result.written.add((down.shape[0], alpha))
        result.targets += 1
    return tensors, patterns


def _ranks_changed(plan, result: ConvertResult) -> bool:
    """Whether a written LoRA module has a (rank, alpha) no source LoRA part had."""
    source = {
        (pp.factors.rank, _alpha(pp, pp.factors.rank)) for pp in plan.planned if pp.part.family == "lora"
    }
    return bool(result.lowrank) or not result.written <= source
