"""Resolve every part of every adapter to pieces of live modules, or to a reason it cannot land."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..arch.aliases import AliasTable
from ..arch.spec import Columns, Piece, module_shape
from ..families import family_for
from ..families.base import Factors, Family, KnownFinite, PartRejected, Shape
from ..formats.adapter import GENERIC_ROLES, Adapter, AdapterPart
from ..formats.alpha import resolve_scale
from ..formats.keys import CLONEOFSIMO_STEM_RE, DENOISER
from ..formats.metadata import cloneofsimo_classes, kohya_number
from ..report.miss import Miss, Unmatched
from .depth import map_depth
from .params import PlannedParam, param_target, plan_param
from .target import Components

# Families a part may carry besides its own: DoRA wraps one inner family; `rescale` is filed under OFT.
ALLOWED_EXTRAS = {"dora": {"lora", "loha", "lokr"}, "boft": {"oft"}}
NOT_PORTABLE = {
    "tlora": "its base comes from an SVD initialisation that is never saved",
    # Stand-In's pipeline appends reference-image tokens and runs these LoRAs on those tokens only.
    "standin": "Stand-In LoRAs act only on the reference-image tokens its own pipeline appends; on every "
    "token they would change the whole video",
}


@dataclass
class PlannedPart:
    adapter: Adapter
    part: AdapterPart
    family: Family  # chosen from the part's keys and shapes (families.family_for)
    component: str
    pieces: tuple[Piece, ...]
    factors: Factors  # the family's own factors record
    scale: float  # γ from alpha/rank or metadata
    alpha_source: str
    strength: float  # per-adapter strength x global strength
    notes: list[str] = field(default_factory=list)  # adaptations the report must mention
    grow: dict[str, tuple[int, str]] = field(default_factory=dict)  # module -> (new input width, config key)
    block_weight: float = (
        1.0  # the adapter's weight for this part's block (strength = adapter strength x this)
    )


@dataclass
class Plan:
    components: Components
    adapters: list[Adapter]
    strengths: dict[str, float]
    planned: list[PlannedPart] = field(default_factory=list)
    unmatched: list[Unmatched] = field(default_factory=list)
    params: list[PlannedParam] = field(default_factory=list)  # patches of bare parameters (resolve/params.py)


def _scalar(tensor: torch.Tensor, key: str) -> float | None:
    if tensor.device.type == "meta":
        return None  # shape-only planning: the value is unknown
    if tensor.numel() != 1:
        raise PartRejected(
            "bad_tensor", f"bad tensor: {key} should be a scalar, has shape {tuple(tensor.shape)}"
        )
    value = float(tensor.reshape(()).float())
    if value != value or value in (float("inf"), float("-inf")):
        raise PartRejected("non_finite", f"bad tensor: {key} is not finite")
    return value


def _role_scalar(adapter: Adapter, part: AdapterPart, role: str) -> float | None:
    """The scalar the part's `role` tensor holds; None when the part has none (or planning is shape-only)."""
    return _scalar(adapter.tensor(part.roles[role]), part.roles[role]) if role in part.roles else None


def network_alpha(adapter: Adapter, metadata_field: str | None) -> float | None:
    """The architecture's `__metadata__` network alpha (MiniMax-H3: the table's `metadata_alpha` field); as
    diffusers, only when no key is `.alpha`. resize reads it the same way, so a resized file keeps its
    scale."""
    if metadata_field is None or adapter.has_alpha_tensors:
        return None
    return kohya_number(adapter.metadata, metadata_field, adapter.path or adapter.name)


def part_scale(
    adapter: Adapter,
    part: AdapterPart,
    family: Family,
    factors: Factors,
    component: str,
    metadata_field: str | None,
) -> tuple[float, str]:
    """(γ, source) of one part landing on `component`: where a part's scale is settled.

    The part's `.alpha`/`.scale` tensors are checked first (a scalar, finite), whatever the family. Families
    that read alpha themselves (OFT & co), full differences and full-rank factors get 1; the rest take the
    first source formats.alpha.resolve_scale finds: `.scale` or `.alpha` tensor, PEFT config, the
    architecture's metadata alpha (`metadata_field`, AliasTable.metadata_alpha), kohya's metadata, then 1."""
    alpha = _role_scalar(adapter, part, "alpha")
    scale_tensor = _role_scalar(adapter, part, "scale")
    if not family.uses_alpha_scale:
        return 1.0, f"none:{part.family}"
    if part.family == "full":
        return 1.0, "none:full"
    if factors.rank is None:  # e.g. LoKr with both factors full: alpha does not apply
        return 1.0, "none:full_rank_factors"
    scale, source = resolve_scale(
        alpha,
        scale_tensor,
        factors.rank,
        factors.is_conv_kernel,
        part.path,
        component if part.explicit_component else "",
        adapter.meta_alpha,
        network_alpha(adapter, metadata_field),
    )
    if not math.isfinite(scale):
        raise PartRejected("non_finite", f"bad tensor: scale from {source} is not finite")
    return scale, source


def _positional_lookup(adapter: Adapter, part: AdapterPart, table: AliasTable) -> tuple[Piece, ...]:
    """cloneofsimo files name layers by index; the metadata lists the ancestor classes that were
    enumerated."""
    m = CLONEOFSIMO_STEM_RE.match(part.path)
    assert m is not None  # the cloneofsimo layout is detected by this very pattern
    classes = cloneofsimo_classes(adapter.metadata, m["component"], adapter.path or adapter.name) or ()
    # lora_diffusion's default targets predate diffusers' rename of CrossAttention to Attention.
    classes = classes or (
        ("CrossAttention", "Attention", "GEGLU") if m["component"] == "unet" else ("CLIPAttention",)
    )
    classes = tuple(dict.fromkeys((*classes, *(("Attention",) if "CrossAttention" in classes else ()))))
    order = table.positional(classes)
    index = int(m["index"])
    if index >= len(order):
        raise PartRejected(
            "no_such_module",
            f"no such module: positional index {index} but the model has {len(order)} Linear layers "
            f"under {', '.join(classes)}",
        )
    return table.exact[order[index]]


def _reshape_target(adapter: Adapter, part: AdapterPart) -> tuple[int, ...] | None:
    """The (out, in) a `reshape_weight` tensor asks the module to have; None when absent or shape-only
    planning."""
    key = part.roles.get("reshape")
    if key is None:
        return None
    tensor = adapter.tensor(key)
    if tensor.device.type == "meta":
        return None
    values = tensor.flatten().tolist()
    if len(values) != 2 or any(v != int(v) or v <= 0 for v in values):
        raise PartRejected(
            "bad_tensor", f"bad tensor: {key} should list a positive (out, in) shape, holds {values}"
        )
    return tuple(int(v) for v in values)


InputFit = Literal["grow", "pad", "other"]


def input_relation(table: AliasTable, module: str, have: int, want: int) -> tuple[InputFit, str] | None:
    """(how, why) an adapter trained on `want` input columns lands on `module`, a declared model input taking
    `have` (arch/spec.py ModelInput): "grow" (a control adapter on an input that takes the latents alone),
    "pad" (trained on the latents alone, on a wider variant), or "other" and why it was trained on inputs
    this model is not fed. None when equal, or when the tree has no latents module to tell by."""
    declared = table.model_inputs[module]
    latents = table.latent_width(declared)
    if latents is None or want == have:
        return None
    grown = declared.control * latents if declared.control else None
    if want > have and have == latents:
        if want == grown:
            return "grow", ""
        takes = (
            f"it grows only to {grown} (latents and a control latent)"
            if grown
            else "it takes no control input"
        )
        return "other", f"asks {module} to grow from {have} to {want} input columns; {takes}"
    if want == latents:
        return "pad", ""
    return "other", (
        f"was trained on {want} input columns; {module} takes {have} here, the latents being the first "
        f"{latents}: only an adapter trained on the latents alone lands on another width"
    )


def _find_pieces(adapter: Adapter, part: AdapterPart, table: AliasTable, where: str) -> tuple[Piece, ...]:
    """The pieces of live modules the part's path names (by index for cloneofsimo files)."""
    found = (
        _positional_lookup(adapter, part, table)
        if part.layout == "cloneofsimo"
        else table.lookup(part.path, adapter.traits)
    )
    unmapped = table.unmapped_why(part.path, found if isinstance(found, tuple) else ())
    if unmapped is not None:  # a runtime's reordered or column-split layout: refused, never mislanded
        raise PartRejected("unsupported", f"unsupported layout: {where} ({unmapped})")
    if found is None:
        why = table.expected_absent(part.path)
        if why is not None:  # a module only a sibling variant has: not a failure
            raise PartRejected("expected_absent", f"expected absent: {where} ({why})")
        raise PartRejected("no_such_module", f"no such module: {where}")
    if isinstance(found, str):  # AMBIGUOUS, the only name lookup returns
        raise PartRejected(
            "ambiguous_module",
            f"ambiguous module name: {where} matches several modules once '.' is written '_'",
        )
    return found


def _supported_family(part: AdapterPart, tensors: dict[str, torch.Tensor], target: str) -> Family:
    """The family that applies the part, refusing a part it would apply only in part (`target`: for the
    report)."""
    family = family_for(part.family, tensors)
    if part.family in NOT_PORTABLE:
        raise PartRejected(
            "unsupported", f"unsupported family: {part.family} ({NOT_PORTABLE[part.family]}; target {target})"
        )
    if family is None:
        raise PartRejected(
            "unsupported", f"unsupported family: {part.family} (not yet supported; target {target})"
        )
    extras = part.extra_families - ALLOWED_EXTRAS.get(part.family, set())
    if extras:
        raise PartRejected(
            "unsupported",
            f"unsupported family: {'+'.join(sorted(extras))} keys next to {part.family} in one part "
            f"(target {target})",
        )
    known = family.roles
    unknown = sorted(set(part.roles) - set(known) - set(GENERIC_ROLES)) if known is not None else []
    if unknown:  # never load a part while ignoring some of its keys
        raise PartRejected(
            "unsupported",
            f"unsupported family: {part.family} part also holds {', '.join(unknown)} (target {target})",
        )
    return family


def _load_factors(
    adapter: Adapter, part: AdapterPart, family: Family, tensors: dict[str, torch.Tensor]
) -> Factors:
    """The family's factors from the part's tensors; alpha stays out where the scale carries it
    (part_scale)."""
    # OFT & co read alpha themselves.
    skip = ("alpha", "scale", "reshape") if family.uses_alpha_scale else ("scale", "reshape")
    # Families whose math depends on settings outside the tensors (PEFT OFT) get the adapter's PEFT config.
    return family.load_part(
        {r: t for r, t in tensors.items() if r not in skip}, part.roles, adapter.meta_alpha.peft
    )


@dataclass
class _Fitting:
    """Fits one part's factors to the modules its pieces name, keeping the adaptations the report must
    mention."""

    family: Family
    table: AliasTable
    comp_name: str
    where: str  # the part's path under its component, for the report
    reshape: tuple[int, ...] | None  # the (out, in) a `reshape_weight` tensor asks for
    notes: list[str] = field(default_factory=list)
    grow: dict[str, tuple[int, str]] = field(default_factory=dict)  # module -> (new input width, config key)

    def piece(self, factors: Factors, module: str) -> Factors:
        """The factors fitted to `module`: as they are, or on another width of a declared model input."""
        shape = module_shape(self.table.modules[module])
        assert shape is not None  # AliasTable.modules holds only modules with a weight shape
        factors, reason = self.family.fit(factors, shape)
        width = self.family.input_width(factors)
        if reason and (why := self.table.variant_input(module, width)):
            # before growth: not a control input
            raise PartRejected("expected_absent", f"expected absent: {self.where} ({why})")
        self._check_reshape(factors, shape, module)
        if reason and width is not None and module in self.table.model_inputs:
            factors, reason = self._other_width(factors, shape, module, width, reason)
        if reason:
            raise PartRejected.of(reason.where(f"{self.comp_name}.{module}"))
        return factors

    def _check_reshape(self, factors: Factors, shape: Shape, module: str) -> None:
        """A `reshape_weight` may only ask a declared model input for the control width the adapter fits."""
        if self.reshape is None or self.reshape == shape:
            return
        relation = None
        if module in self.table.model_inputs and self.reshape[0] == shape[0]:
            relation = input_relation(self.table, module, shape[1], self.reshape[1])
        if relation is not None and relation[0] == "other":
            raise PartRejected("other_input", f"other input: {self.where} {relation[1]}")
        grows = relation is not None and relation[0] == "grow"
        if not grows or self.family.fit(factors, (shape[0], self.reshape[1]))[1] is not None:
            raise PartRejected(
                "shape_mismatch",
                f"shape mismatch: reshape_weight asks {self.comp_name}.{module} {shape} to become "
                f"{self.reshape}; only declared model inputs can grow, and only in columns",
            )

    def _other_width(
        self, factors: Factors, shape: Shape, module: str, width: int, reason: Miss
    ) -> tuple[Factors, Miss | None]:
        """(factors, reason) of an adapter trained on `width` input columns of a declared model input taking
        another: grown into or zero-padded to it where the architecture declares the relation (reason None),
        refused as trained on other inputs where it does not, `reason` kept where the adapter would not fit
        even at its own width."""
        if self.family.fit(factors, (shape[0], width))[1] is not None:
            return factors, reason
        how, why = input_relation(self.table, module, shape[1], width) or (None, "")
        if how == "grow":
            factors = self.family.settle(factors, (shape[0], width))
            config_key = self.table.model_inputs[module].config_key
            self.grow[module] = (width, config_key)
            self.notes.append(
                f"{module} input grown {shape[1]} -> {width} columns (zero weights for the new "
                f"channels; config {config_key} updated)"
            )
            return factors, None
        if how == "pad":
            widened = self.family.widen_input(factors, shape)
            fitted = self.family.fit(widened, shape) if widened is not None else (factors, reason)
            if fitted[1] is not None:
                return factors, reason
            self.notes.append(
                f"input zero-padded to {shape[1]} columns (model variant with a wider {module})"
            )
            return fitted[0], None
        if how == "other":
            raise PartRejected("other_input", f"other input: {self.where} {why}")
        return factors, reason


def _check_rows(family: Family, factors: Factors, found: tuple[Piece, ...], comp_name: str) -> None:
    """The adapter's output rows cover the pieces exactly, and each piece is a slice the family may take."""
    total = sum(p.length for p in found)
    # rows None: the delta spans any rows (IA3 on the input)
    if factors.rows is not None and factors.rows != total:
        names = " | ".join(f"{p.module}[{p.dst_start}:{p.dst_start + p.length}]" for p in found)
        raise PartRejected(
            "shape_mismatch",
            f"shape mismatch: adapter has {factors.rows} output rows, target {names} has {total}",
        )
    for piece in found:  # row-slice rules: OFT blocks must tile a piece, ...
        reason = family.check_piece(factors, piece.src_start, piece.length)
        if reason:
            raise PartRejected.of(reason.where(f"{comp_name}.{piece.module}"))


def _plan_part(
    adapter: Adapter, part: AdapterPart, comp_name: str, table: AliasTable, strength: float
) -> tuple[PlannedPart | PlannedParam, ...]:
    """The part planned: one record, or one per live module of a layer the runtime splits by columns."""
    param = param_target(part, table)
    if param is not None:
        return (plan_param(adapter, part, comp_name, table, param, strength),)
    split = table.column_split(part.path) if part.layout != "cloneofsimo" else None
    if split is not None:
        return _plan_columns(adapter, part, comp_name, table, strength, split)
    where = f"{comp_name}.{part.path}"
    found = _find_pieces(adapter, part, table, where)
    tensors = {role: adapter.tensor(key) for role, key in part.roles.items()}
    family = _supported_family(part, tensors, f"{comp_name}.{', '.join(p.module for p in found)}")
    finite = getattr(adapter.source, "finite_keys", lambda: None)()  # proven in bulk by the source, or None
    with KnownFinite(tensors[r] for r, k in part.roles.items() if finite is not None and k in finite):
        factors = _load_factors(adapter, part, family, tensors)
    factors = _interleave_rows(family, factors, found, table, where)
    fitting = _Fitting(family, table, comp_name, where, _reshape_target(adapter, part))
    # First: a family may settle its layout from the module shape (GLoRA naming, IA3 side).
    for piece in found:
        factors = fitting.piece(factors, piece.module)
    _check_rows(family, factors, found, comp_name)
    scale, source = part_scale(adapter, part, family, factors, comp_name, table.metadata_alpha)
    return (
        PlannedPart(
            adapter,
            part,
            family,
            comp_name,
            found,
            factors,
            scale,
            source,
            strength,
            fitting.notes,
            fitting.grow,
        ),
    )


def _interleave_rows(
    family: Family, factors: Factors, found: tuple[Piece, ...], table: AliasTable, where: str
) -> Factors:
    """The factors with their rows gathered into a runtime's interleaved order (Nunchaku's modulation: live
    row d·chunks + c holds the file's row c·dim + d); as they are where no piece lands on such a module."""
    chunks = next((c for p in found if (c := table.row_chunks(p.module))), None)
    if chunks is None:
        return factors
    module, rows = found[0].module, factors.rows
    why = f"the runtime interleaves {module}'s {chunks} output chunks per unit"
    if len(found) != 1 or not found[0].whole or rows is None or rows % chunks:
        raise PartRejected("unsupported", f"unsupported layout: {where} ({why}; the delta covers other rows)")
    index = torch.arange(rows).view(chunks, rows // chunks).T.reshape(-1)
    gathered = family.gather_rows(factors, index)
    if gathered is None:
        raise PartRejected(
            "unsupported",
            f"unsupported layout: {where} ({why}; a {family.name} delta's rows do not reorder on their own: "
            "only LoRA and full diffs do)",
        )
    return gathered


def _plan_columns(
    adapter: Adapter,
    part: AdapterPart,
    comp_name: str,
    table: AliasTable,
    strength: float,
    split: tuple[Columns, ...],
) -> tuple[PlannedPart, ...]:
    """A layer the runtime holds as several modules over consecutive input columns (Nunchaku's single-block
    proj_out): each module gets ΔW's columns it reads, whole; the first carries the bias term. Exact for
    families whose ΔW is additive in its columns; families acting on the layer's output (DoRA, OFT) refuse."""
    where = f"{comp_name}.{part.path}"
    names = " + ".join(f"{c.module}[:, {c.start}:{c.start + c.width}]" for c in split)
    tensors = {role: adapter.tensor(key) for role, key in part.roles.items()}
    family = _supported_family(part, tensors, f"{comp_name}.{names}")
    factors = _load_factors(adapter, part, family, tensors)
    width = family.input_width(factors)
    total = split[-1].start + split[-1].width
    if width is not None and width != total:
        raise PartRejected(
            "shape_mismatch", f"shape mismatch: {where} has {width} input columns, {names} take {total}"
        )
    scale, source = part_scale(adapter, part, family, factors, comp_name, table.metadata_alpha)
    planned = []
    for n, columns in enumerate(split):
        piece_factors = family.take_columns(factors, columns.start, columns.width, n == 0)
        if piece_factors is None:
            raise PartRejected(
                "unsupported",
                f"unsupported layout: {where} (the runtime splits this layer by input columns over {names}; "
                f"a {family.name} delta does not split by columns: only additive low-rank or dense terms do)",
            )
        fitting = _Fitting(family, table, comp_name, where, None)
        piece_factors = fitting.piece(piece_factors, columns.module)
        pieces = (Piece(columns.module, 0, 0, piece_factors.rows, True),)
        _check_rows(family, piece_factors, pieces, comp_name)
        planned.append(
            PlannedPart(
                adapter, part, family, comp_name, pieces, piece_factors, scale, source, strength, [], {}
            )
        )
    return tuple(planned)


def _plan_with_fallback(
    adapter: Adapter,
    part: AdapterPart,
    comp_name: str,
    components: Components,
    tables: dict[str, AliasTable],
    strength: float,
) -> tuple[PlannedPart | PlannedParam, ...]:
    try:
        return _plan_part(adapter, part, comp_name, tables[comp_name], strength)
    except PartRejected as first:
        # A bare key names no component: try the others before giving up.
        others = [n for n in components.modules if n != comp_name] if not part.explicit_component else []
        for other in others:
            try:
                return _plan_part(adapter, part, other, tables[other], strength)
            except PartRejected:
                continue
        raise first from None


def _depth_mapped(
    adapter: Adapter, components: Components, tables: dict[str, AliasTable]
) -> tuple[Adapter, dict[int, str]]:
    """The adapter with its blocks at the model's depth (resolve/depth.py); as it is without a denoiser."""
    denoiser = components.denoiser_name
    if denoiser is None:
        return adapter, {}
    return map_depth(adapter, components.modules[denoiser], tables[denoiser])


def resolve(
    components: Components,
    adapters: list[tuple[Adapter, float]],
    tables: dict[str, AliasTable] | None = None,
    experts: dict[str, tuple[str, ...]] | None = None,
) -> Plan:
    """Plan every part of every adapter; `tables` reuses alias tables built for these components before.

    `experts`: adapter name -> the denoiser components its denoiser keys land on, each (Wan 2.2's
    `transformer` and `transformer_2` take one file); default: the pipeline's denoiser only."""
    plan = Plan(components, [a for a, _ in adapters], {a.name: s for a, s in adapters})
    tables = tables if tables is not None else {name: AliasTable(module) for name, module in components}
    for adapter, strength in adapters:
        for item in adapter.unparsed:
            plan.unmatched.append(
                Unmatched(adapter.name, item["key"], Miss("not_parsed", f"not parsed: {item['reason']}"))
            )
        fan = (experts or {}).get(adapter.name)
        moved, depth_notes = _depth_mapped(adapter, components, tables)
        for part in moved.parts:
            names = fan if fan and part.component == DENOISER else (components.resolve_name(part.component),)
            for comp_name in names:
                try:
                    if comp_name is None:
                        raise PartRejected(
                            "no_such_component",
                            f"no such component: {part.component} "
                            f"(target has {', '.join(components.modules)})",
                        )
                    if fan and part.component == DENOISER:  # each expert gets the part, none is a fallback
                        planned = _plan_part(moved, part, comp_name, tables[comp_name], strength)
                    else:
                        planned = _plan_with_fallback(moved, part, comp_name, components, tables, strength)
                    for one in planned:
                        one.adapter = adapter  # the caller's object: reports address it by identity
                        if id(part) in depth_notes:
                            one.notes.append(depth_notes[id(part)])
                        if isinstance(one, PlannedParam):
                            plan.params.append(one)
                        else:
                            plan.planned.append(one)
                except PartRejected as rejected:
                    plan.unmatched += [Unmatched(adapter.name, key, rejected.miss) for key in part.keys]
    return plan
