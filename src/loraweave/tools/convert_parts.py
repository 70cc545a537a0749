"""What `convert` and `merge` add to the LoRA regrouping of `tools/convert`: the source's metadata carried
over (only what the rewrite changes is rewritten, and the result says which), LoKr/LoHa parts written as they
are under another layout's names, and any family's part as a truncated SVD of its ΔW (captured energy
reported)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..errors import ConvertError
from ..formats.adapter import Adapter, load_adapter
from ..formats.alpha import read_metadata_alpha
from ..formats.keys import TEXTUAL_INVERSION
from ..io.output import check_output
from ..io.write import atomic_path, save_file
from ..resolve.planner import PlannedPart, resolve
from ..resolve.target import Components

if TYPE_CHECKING:
    from .layout_names import Pair, Span

LYCORIS_AS_IS = ("lokr", "loha")  # families whose kohya/comfy keys differ from the source's only by stem
KOHYA_NAMED = ("kohya", "comfy")  # layouts with lora_down / lora_up / alpha keys (and no LoRA bias)
AS_IS_LAYOUTS = KOHYA_NAMED  # layouts that name LyCORIS factors as LyCORIS does (stem + .lokr_w1 ...)

# Fields that describe the source file's bytes, not the adapter: wrong for any rewritten file.
HASH_FIELDS = ("sshs_model_hash", "sshs_legacy_hash", "modelspec.hash_sha256")
# Fields the writer sets itself (alpha/rank now live in the keys or the written config).
REWRITTEN_FIELDS = ("lora_adapter_metadata", "loraweave.converted")


def carried_metadata(source: dict[str, str], ranks_changed: bool, to_lora: bool):
    """(the source's metadata with what the rewrite changes taken out, {field: why}).

    `ranks_changed`: some written module has a (rank, alpha) no source part had (joined by rank
    concatenation, pruned, truncated); `to_lora`: some part changed family (LoKr/LoHa -> LoRA), so the
    network module and its args no longer describe the file."""
    kept = dict(source)
    why: dict[str, str] = {}
    for key in HASH_FIELDS:
        if kept.pop(key, None) is not None:
            why[key] = "a hash of the source file's bytes; dropped"
    for key in REWRITTEN_FIELDS:
        if kept.pop(key, None) is not None:
            why[key] = "rewritten for the output layout"
    if ranks_changed:
        for key in ("ss_network_dim", "ss_network_alpha"):
            if kept.pop(key, None) is not None:
                why[key] = "no longer the modules' rank/alpha (ranks joined, pruned or truncated); dropped"
    if to_lora:
        if kept.get("ss_network_module", "networks.lora") != "networks.lora":
            kept["ss_network_module"] = "networks.lora"
            why["ss_network_module"] = "LoKr/LoHa parts written as LoRA: networks.lora"
        if kept.pop("ss_network_args", None) is not None:
            why["ss_network_args"] = "the source network's algorithm arguments; dropped"
    return kept, why


def in_shape_of(plan, pp: PlannedPart) -> tuple[int, ...]:
    """(in, *kernel) of the module the part's first piece lands on."""
    module = plan.components.modules[pp.component].get_submodule(pp.pieces[0].module)
    return tuple(module.weight.shape[1:])


def svd_pair(plan, pp: PlannedPart, coeff: float, rank: int | None) -> tuple[Pair, float]:
    """((down (r, in, *k), up (rows, r), alpha = r), captured energy): the part's coeff·ΔW truncated to
    `rank` by SVD (all of its energy when None: exact to rounding). LoKr and non-Tucker LoHa go through their
    exact low-rank structure (resize's: two small SVDs, or the r1·r2 LoRA), the rest through the dense ΔW."""
    from .resize import low_rank  # resize's structured truncation

    in_shape = in_shape_of(plan, pp)
    # without a rank: all the energy but rounding noise (1e-14 of Σσ², far below fp32 rounding)
    up, down, _, captured = low_rank(pp.part, pp.factors, coeff, rank, None if rank else 1 - 1e-14)
    r = down.shape[0]
    return (down.float().reshape(r, *in_shape), up.float(), float(r)), captured


def as_is_tensors(spans: list[Span], pp: PlannedPart, stem: str) -> dict[str, torch.Tensor]:
    """A LoKr/LoHa part's own tensors under `stem` (its alpha as a tensor, so γ holds without metadata).

    Only a part that lands whole, in order, on one target name can keep its family: a Kronecker or Hadamard
    product cannot be cut into row blocks of its own family."""
    mine = [s for s in spans if s.pp is pp]
    rows = pp.factors.rows
    whole = (
        len(mine) == 1 and mine[0].row == 0 and mine[0].src == 0 and mine[0].length == rows == mine[0].total
    )
    if not whole:
        where = ", ".join(sorted({s.name for s in mine}))
        raise ConvertError(
            f"{pp.adapter.path or pp.adapter.name}: {pp.part.family} part {pp.part.stem} spans {where} in "
            "this layout (fused rows split or reordered), which its own family cannot express; pass --rank R "
            "to write it as a LoRA; nothing written"
        )
    out = {}
    for role, key in pp.part.roles.items():
        suffix = key[len(pp.part.stem) :] if key.startswith(pp.part.stem) else "." + role
        out[stem + suffix] = pp.adapter.tensor(key).contiguous()
    own_scale = "alpha" in pp.part.roles or "scale" in pp.part.roles
    if not own_scale and pp.factors.rank is not None and pp.family.uses_alpha_scale:
        # γ came from metadata (or the default): written as the tensor every loader reads first
        out[stem + ".alpha"] = torch.tensor(pp.scale * pp.factors.rank, dtype=torch.float32)
    return out


def take_embeddings(adapter: Adapter, source: object, drop: bool) -> list[str]:
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


def alpha_metadata(to: str, patterns: dict[str, dict], components: Components) -> tuple[dict, dict | None]:
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


def self_check(tensors, metadata, config, components: Components, out: Path, plan) -> None:
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
    before = {(pp.component, p.module) for pp in plan.planned for p in pp.pieces if _changes(pp, p)}
    after = {(pp.component, p.module) for pp in check.planned for p in pp.pieces}
    if not before <= after:
        raise ConvertError(
            f"converted keys would miss {sorted(before - after)[:3]}; nothing written to {out}"
        )


def _changes(pp: PlannedPart, piece) -> bool:
    """Whether the part changes the piece's rows: a LoRA's up rows, or every factor of a product family
    nonzero (a zero factor, as some trainers leave untrained layers, makes ΔW zero and nothing is written)."""
    if pp.part.family == "lora":
        return bool(pp.factors.up[piece.src_start : piece.src_start + piece.length].any())
    fields = vars(pp.factors).values()
    values = [v for value in fields for v in (value if isinstance(value, tuple) else (value,))]
    return all(bool(t.any()) for t in values if isinstance(t, torch.Tensor))


def write_peft(tensors, config, out: Path, inputs, overwrite: bool, metadata: dict[str, str]) -> None:
    check_output(out, inputs, overwrite=overwrite, folder=True)
    with atomic_path(out, folder=True) as tmp:
        save_file(tensors, tmp / "adapter_model.safetensors", metadata)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
