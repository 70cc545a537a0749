"""`convert`: rewrite an adapter in another trainer layout (kohya, peft, diffusers, comfy) without changing
what it does. Every part is resolved against the model (full size on `meta`, or a given module) into row
ranges of live modules, then regrouped under the names the target layout uses: fused rows are split (shared
down, up rows cut) or joined (shared down when equal, else rank concatenation), alpha is carried so γ =
alpha/rank is unchanged. The output is re-resolved before it is written; a key that would not land aborts the
conversion."""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..arch.aliases import missing_file_prefix
from ..errors import ArgumentError, ConvertError, EmptyOutputError
from ..formats.adapter import Adapter, load_adapter
from ..formats.alpha import read_metadata_alpha
from ..formats.keys import TEXTUAL_INVERSION, component_prefix
from ..io.output import check_output
from ..io.write import save_file
from ..progress import bar
from ..resolve.planner import PlannedPart, resolve
from ..resolve.target import Components, as_components
from .remap import Spans, original_spans

log = logging.getLogger("loraweave")
LAYOUTS = ("kohya", "peft", "diffusers", "comfy")


@dataclass
class _Piece:
    """Rows [row, row+length) of a target name receive up_rows @ down, scaled by alpha/rank."""

    row: int
    length: int
    down: torch.Tensor  # (r, in, *k)
    up: torch.Tensor  # (length, r)
    alpha: float
    pp: PlannedPart


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

    def to_dict(self) -> dict:
        return {**vars(self), "output": str(self.output)}


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


def _uses_original_names(layout: str, component: str, module: torch.nn.Module) -> bool:
    if layout == "comfy":
        return component == "denoiser"
    if layout != "kohya" or component != "denoiser":
        return False
    # kohya: SD1/SD2 UNets in diffusers names, SDXL in sgm names, DiTs in their original (BFL, Wan) names.
    if type(module).__name__ == "UNet2DConditionModel":
        return getattr(getattr(module, "config", None), "addition_embed_type", None) == "text_time"
    return True


def _naming(layout: str, comp: str, module: torch.nn.Module, denoiser: bool) -> tuple[Spans, dict[str, int]]:
    """Spans to original names where the layout writes them for this component; empty: live names."""
    if not _uses_original_names(layout, "denoiser" if denoiser else comp, module):
        return {}, {}
    return original_spans(module)


def _regroup(plan, layout: str) -> dict[tuple[str, str], tuple[int, list[_Piece]]]:
    """{(component, target name): (rows, pieces)} for every LoRA part of the plan."""
    groups: dict[tuple[str, str], tuple[int, list[_Piece]]] = {}
    namings = {c: _naming(layout, c, m, c == plan.components.denoiser_name) for c, m in plan.components}
    # CLIP layers under `text_model.` as every trainer writes them, even where this tree lacks it
    prefixes = {c: missing_file_prefix(m) for c, m in plan.components}
    for pp in plan.planned:
        f = pp.factors
        for piece in pp.pieces:
            module = plan.components.modules[pp.component].get_submodule(piece.module)
            rows = module.weight.shape[0]
            named, totals = namings[pp.component]
            spans = named.get(piece.module) or [(prefixes[pp.component] + piece.module, 0, 0, rows)]
            for name, t_start, m_start, length in spans:
                lo = max(piece.dst_start, m_start)
                hi = min(piece.dst_start + piece.length, m_start + length)
                if lo >= hi:
                    continue
                total = totals.get(name, rows)
                src = piece.src_start + (lo - piece.dst_start)
                up = f.up[src : src + hi - lo]
                if not bool(up.any()) and (
                    f.up_bias is None or not bool(f.up_bias[src : src + hi - lo].any())
                ):
                    # rows this part leaves untouched (a zero block of a joined LoRA): nothing to write
                    continue
                entry = groups.setdefault((pp.component, name), (total, []))
                entry[1].append(_Piece(t_start + lo - m_start, hi - lo, f.down, up, _alpha(pp, f.rank), pp))
    return groups


def _prune(down: torch.Tensor, up: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Drop rank columns whose up column is all zero (the other rows' share after a split); γ is kept."""
    keep = up.flatten(1).ne(0).any(0)
    if bool(keep.all()) or not bool(keep.any()):
        return down, up, alpha
    rank = down.shape[0]
    return down[keep], up[:, keep], alpha / rank * int(keep.sum())


Assembled = tuple[torch.Tensor, torch.Tensor, float]  # (down, up, alpha) of one target module


def _assemble(rows: int, pieces: list[_Piece], result: ConvertResult) -> Assembled:
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


def _assemble_shared(rows: int, pieces: list[_Piece], result: ConvertResult) -> Assembled:
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


def _assemble_stacked(rows: int, pieces: list[_Piece], result: ConvertResult) -> Assembled:
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


def _stem(
    layout: str, comp: str, name: str, denoiser: bool, components: Components, source: object = ""
) -> str:
    if layout == "kohya":
        prefix: str | None  # component_prefix knows no prefix for some components
        if denoiser:
            prefix = "lora_unet_"
        elif comp == "text_encoder":
            prefix = "lora_te1_" if "text_encoder_2" in components.modules else "lora_te_"
        # the parser's own table: lora_te2_, lora_te3_; Anima's text_conditioner -> lora_unet_llm_adapter_
        else:
            prefix = component_prefix(comp, "kohya")
        if prefix is None:
            raise ConvertError(f"{source}: kohya layout has no prefix for component {comp}; nothing written")
        return prefix + name.replace(".", "_")
    if layout == "comfy":
        if denoiser:
            return "diffusion_model." + name
        prefix = component_prefix(
            comp, "comfyui"
        )  # text_encoders.clip_l/clip_g.transformer., llm_adapter, ...
        if prefix is None:
            raise ConvertError(f"{source}: comfy layout has no prefix for component {comp}; nothing written")
        return prefix + name
    if layout == "peft":
        return "base_model.model." + name
    return f"{comp}.{name}"


def _target_components(adapter: Adapter, target, arch: str | None, model: str | None) -> Components:
    if target is not None:
        return as_components(target)
    from .target import adapter_target

    components, why, detected = adapter_target(adapter, arch, model)
    if components is None and arch is None and model is None and detected == "unknown":
        raise ConvertError(
            f"{adapter.path or 'adapter'}: its keys name no known architecture; pass --arch NAME or --model "
            "CHECKPOINT to say what it was trained on"
        )
    if components is None:
        raise ConvertError(f"cannot convert without a model: {why}")
    return Components(components)


KOHYA_NAMED = ("kohya", "comfy")  # layouts with lora_down / lora_up / alpha keys (and no LoRA bias)


def _refuse_unconvertible(plan, to: str) -> None:
    """Refuse keys that resolve to no target name, non-LoRA parts, and a LoRA bias the layout cannot hold."""
    if plan.unmatched:
        reasons = sorted({u["reason"] for u in plan.unmatched})[:5]
        raise ConvertError(
            f"{len(plan.unmatched)} keys do not resolve against the model, so their target names are "
            f"unknown: {'; '.join(reasons)}"
        )
    other = sorted({pp.part.family for pp in plan.planned if pp.part.family != "lora"})
    if other:
        raise ConvertError(
            f"convert handles the LoRA family; this file also holds {', '.join(other)} parts "
            "(their factor layouts differ per trainer, so no lossless rename is offered)"
        )
    if any(pp.factors.up_bias is not None for pp in plan.planned) and to in KOHYA_NAMED:
        raise ConvertError(f"{to} layout has no LoRA bias (lora_B.bias) keys")


def _module_tensors(
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
    bias = [(p.row, p.length, p.pp.factors.up_bias) for p in pieces if p.pp.factors.up_bias is not None]
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
) -> ConvertResult:
    """Write the adapter at `path` in layout `to`; `target` (module / mapping) overrides `arch` / `model`.

    An adapter with no key is refused (EmptyOutputError, nothing written) unless `allow_empty`.
    Textual-inversion tokens, which no adapter layout carries, are refused (ConvertError) unless
    `drop_embeddings` leaves them out; the result names them."""
    if to not in LAYOUTS:
        raise ArgumentError(f"--to must be one of {LAYOUTS}")
    inputs = [path] if isinstance(path, (str, os.PathLike)) else []
    out = check_output(output, inputs, overwrite=overwrite, folder=to == "peft")
    adapter = load_adapter(path, allow_pickle=allow_pickle)
    dropped = _embeddings(adapter, path if inputs else adapter.name, drop_embeddings)
    if not adapter.keys_total and not allow_empty:
        raise EmptyOutputError(
            f"{path}: the adapter holds no key; the output would be empty; nothing written "
            "(--allow-empty writes it anyway)"
        )
    components = _target_components(adapter, target, arch, model)
    plan = resolve(components, [(adapter, 1.0)])
    _refuse_unconvertible(plan, to)
    result = ConvertResult(out, to, keys_in=adapter.keys_total, dropped_embeddings=dropped)
    if dropped:
        result.notes.append(f"dropped textual-inversion token embeddings: {', '.join(dropped)}")
    tensors: dict[str, torch.Tensor] = {}
    patterns: dict[str, dict] = {}
    groups = _regroup(plan, to)
    for (comp, name), (rows, pieces) in bar(
        groups.items(), total=len(groups), desc="convert", unit="module", enabled=progress
    ):
        down, up, alpha = _assemble(rows, pieces, result)
        denoiser = comp == components.denoiser_name
        stem = _stem(to, comp, name, denoiser, components, source=path if inputs else adapter.name)
        tensors.update(_module_tensors(to, stem, down, up, alpha, rows, pieces))
        if to not in KOHYA_NAMED:
            patterns.setdefault(comp, {})[name] = (down.shape[0], alpha)
        result.targets += 1
    metadata, config = _alpha_metadata(to, patterns, components)
    result.notes = sorted(set(result.notes))
    _self_check(tensors, metadata, config, components, out, plan)
    result.keys_out = len(tensors)
    if to == "peft":
        _write_peft(tensors, config, out, inputs, overwrite)
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


def _embeddings(adapter: Adapter, source: object, drop: bool) -> list[str]:
    """The file's textual-inversion tokens, taken out of `adapter` when `drop`; refused when not."""
    tokens = [u["key"] for u in adapter.unparsed if u["reason"] == TEXTUAL_INVERSION]
    if tokens and not drop:
        raise ConvertError(
            f"{source}: holds textual-inversion token embeddings ({', '.join(tokens)}), which no adapter "
            f"layout "
            "carries; --drop-embeddings converts the adapter without them (keep this file for the tokens); "
            "nothing written"
        )
    adapter.unparsed = [u for u in adapter.unparsed if u["reason"] != TEXTUAL_INVERSION]
    return tokens


def _alpha_metadata(to: str, patterns: dict[str, dict], components: Components) -> tuple[dict, dict | None]:
    """kohya/comfy carry alpha tensors; peft/diffusers carry r, lora_alpha and per-module patterns (PEFT
    config)."""
    if to in KOHYA_NAMED:
        return {"loraweave.converted": to}, None
    config: dict = {}
    for comp, mods in patterns.items():
        common = max(set(mods.values()), key=list(mods.values()).count)
        # Pattern keys match any module whose name ends in `.key`: once one module deviates, every module gets
        # an exact, escaped entry, longest names first, so a short name never captures a longer one's setting.
        uniform = len(set(mods.values())) == 1
        ordered = sorted(mods, key=lambda m: (-len(m), m))
        cfg = {
            "r": common[0],
            "lora_alpha": common[1],
            "rank_pattern": {} if uniform else {re.escape(m): mods[m][0] for m in ordered},
            "alpha_pattern": {} if uniform else {re.escape(m): mods[m][1] for m in ordered},
            "target_modules": sorted(mods),
        }
        if to == "peft":
            if len(patterns) > 1:
                raise ConvertError(
                    f"peft layout holds one model; this adapter spans {', '.join(sorted(patterns))} "
                    "(use --to diffusers)"
                )
            return {}, {"peft_type": "LORA", **cfg}
        config.update({f"{comp}.{k}": v for k, v in cfg.items()})
    return {"lora_adapter_metadata": json.dumps(config), "loraweave.converted": to}, config


def _self_check(tensors, metadata, config, components: Components, out: Path, plan) -> None:
    """Resolve the converted keys against the same model; same modules hit and every key lands, or no
    output."""
    probe = load_adapter(tensors, name="converted")
    probe.metadata = dict(metadata)
    peft_file = config is not None and "peft_type" in config
    probe.meta_alpha = read_metadata_alpha({}, config) if peft_file else read_metadata_alpha(probe.metadata)
    check = resolve(components, [(probe, 1.0)])
    if check.unmatched:
        raise ConvertError(
            f"converted keys would not land ({check.unmatched[0]['key']}: "
            f"{check.unmatched[0]['reason']}); nothing written to {out}"
        )
    before = {
        (pp.component, p.module)
        for pp in plan.planned
        for p in pp.pieces
        if bool(pp.factors.up[p.src_start : p.src_start + p.length].any())
    }
    after = {(pp.component, p.module) for pp in check.planned for p in pp.pieces}
    if not before <= after:
        raise ConvertError(
            f"converted keys would miss {sorted(before - after)[:3]}; nothing written to {out}"
        )


def _write_peft(tensors, config, out: Path, inputs, overwrite: bool) -> None:
    from ..io.output import check_output
    from ..io.write import atomic_path

    check_output(out, inputs, overwrite=overwrite, folder=True)
    with atomic_path(out, folder=True) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors")
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
