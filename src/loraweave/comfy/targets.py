"""loraweave's own resolver onto the modules of ComfyUI's diffusion model and CLIP (never ComfyUI's key maps).

ComfyUI keeps original module names (ldm `input_blocks.1.1...`, BFL `double_blocks.0.img_attn.qkv`). Adapter
keys resolve against the diffusers tree of the detected architecture (built on `meta` at the ComfyUI model's
own widths), where every layout loraweave reads lands; the planned rows then go back to the original tensors
through the inverted alias tables (`tools.remap`), so a Plan here names ComfyUI modules and their rows. Text
encoders resolve on ComfyUI's own CLIP modules (their names are the transformers ones)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..arch.aliases import AliasTable, bare_parameters
from ..arch.spec import out_rows
from ..engine.decide import refuse_strict
from ..engine.install import make_report
from ..errors import TargetError
from ..formats.adapter import Adapter
from ..formats.keys import DENOISER_NAMES, TEXT_ENCODER_NAMES
from ..report.miss import Miss, Unmatched
from ..report.report import failures
from ..resolve.modality import modalities_named
from ..resolve.params import PlannedParam
from ..resolve.planner import Plan, PlannedPart, resolve
from ..resolve.target import Components
from ..resolve.weights import weigh_modalities
from ..tools.remap import Spans, original_fit, translate
from .grow import loaded_shapes
from .reference import COMFY_ARCHS, reference_config
from .skeletons import packaged_tree

log = logging.getLogger("loraweave")

DENOISER_PREFIX = "diffusion_model"  # ModelPatcher state-dict keys: diffusion_model.<module>.weight
# Pipeline components that ComfyUI keeps inside its diffusion model, by attribute: Anima's LLM adapter
# (diffusers' `text_conditioner`; the key parser routes `diffusion_model.llm_adapter.` and
# `lora_unet_llm_adapter_` there).
INNER_COMPONENTS: dict[str, str] = {"text_conditioner": "llm_adapter"}
# ComfyUI text encoder attributes in kohya's order (lora_te1_, lora_te2_, lora_te3_); others follow in tree
# order.
ENCODER_ORDER = ("clip_l", "clip_g", "t5xxl")


def comfy_arch(patcher) -> str | None:
    """The loraweave architecture of a ComfyUI MODEL, from its supported_models class or the nearest base
    class we map (FluxInpaint is a Flux, SSD-1B an SDXL, WAN21_Vace a Wan: their own modules fall to ComfyUI's
    names); None: not one we map."""
    archs = dict(COMFY_ARCHS)
    for cls in type(getattr(patcher.model, "model_config", None)).__mro__:
        if cls.__name__ in archs:
            return archs[cls.__name__]
    return None


FITS_KEPT = 4  # live shape sets kept per reference: one per ComfyUI model of that config in use


@dataclass(eq=False)
class Reference:
    """A reference tree and what planning derives from the tree alone, built once per config (planning never
    writes to the tree): resolve's alias table, the parameter aliases, and the spans onto each set of live
    shapes seen (a pure function of the tree and the shapes, so a model of other shapes never gets another's
    spans)."""

    tree: torch.nn.Module
    component: str  # the resolver's name for it: "unet" or "transformer"
    table: AliasTable
    originals: dict[str, str]  # _original_params(tree)
    fits: OrderedDict[tuple, tuple[Spans] | None] = field(default_factory=OrderedDict)

    @classmethod
    def of(cls, tree: torch.nn.Module) -> Reference:
        name = "unet" if type(tree).__name__.startswith("UNet") else "transformer"
        return cls(tree, name, AliasTable(tree), _original_params(tree))

    def spans_for(self, shapes: dict[str, tuple[int, ...]]) -> Spans | None:
        """The spans onto ComfyUI's tensors of these shapes (None: the widths do not fit), computed once."""
        key = tuple(shapes.items())
        if key not in self.fits:
            fit = original_fit(self.tree, shapes, renamed=True) or _same_names(self.tree, shapes)
            self.fits[key] = (fit[0],) if fit is not None else None
            while len(self.fits) > FITS_KEPT:
                self.fits.popitem(last=False)
        self.fits.move_to_end(key)
        found = self.fits[key]
        return found[0] if found is not None else None


@functools.lru_cache(maxsize=8)
def _meta_tree(arch: str, cls_name: str, config_json: str) -> Reference:
    # Planning never writes to the tree, so one per config serves every call. The shipped skeleton serves
    # every full-width model (any depth) without importing diffusers' model classes; other widths build from
    # diffusers.
    t0 = time.perf_counter()
    config = json.loads(config_json)
    tree = packaged_tree(arch, cls_name, config)
    source = "package"
    if tree is None:
        import diffusers

        with torch.device("meta"):
            tree = getattr(diffusers, cls_name).from_config(config)
        source = "diffusers"
    reference = Reference.of(tree)
    log.info("comfy reference arch=%s source=%s seconds=%.3f", arch, source, time.perf_counter() - t0)
    return reference


ONLY_COMFY_NAMES = (
    "keys are matched by ComfyUI's own module names only (a key named after diffusers' modules cannot land "
    "or be judged on it)"
)


def reference_or_why(patcher) -> tuple[tuple[Reference, Spans] | None, str | None]:
    """((the cached reference of this model's config, spans onto its tensors), None), or (None, why there is
    none: no architecture mapped, widths that do not fit, or a tree that needs diffusers where it is not
    installed)."""
    arch = comfy_arch(patcher)
    if arch is None:
        return None, f"loraweave maps no architecture onto {comfy_model_name(patcher)}: {ONLY_COMFY_NAMES}"
    from ..arch.catalog import CATALOG

    entry = CATALOG[arch]
    config = {**entry.config, **reference_config(arch, patcher.model.model_config.unet_config)}
    try:
        reference = _meta_tree(arch, entry.cls, json.dumps(config, sort_keys=True, default=list))
    except ModuleNotFoundError as exc:  # no shipped skeleton fits; ComfyUI does not ship diffusers
        log.warning("comfy reference arch=%s source=none missing_module=%s", arch, exc.name)
        return None, (
            f"loraweave's {arch} reference for this model's widths is built from diffusers' classes, and "
            f"{exc.name} is not installed (pip install 'loraweave[comfy]' into ComfyUI's Python): "
            f"{ONLY_COMFY_NAMES}"
        )
    shapes = loaded_shapes(patcher.model.diffusion_model)  # as loaded: a grown clone may be loaded now
    spans = reference.spans_for(shapes)
    if spans is None:
        log.warning("comfy reference arch=%s fits=no (widths differ from loraweave's reference)", arch)
        return None, f"loraweave's {arch} reference does not fit this model's widths: {ONLY_COMFY_NAMES}"
    return (reference, spans), None


def _reference(patcher) -> tuple[Reference, Spans] | None:
    return reference_or_why(patcher)[0]


def comfy_model_name(patcher) -> str:
    """How ComfyUI names the model: its supported_models class, else the model's class (another pack's)."""
    config = getattr(patcher.model, "model_config", None)
    return type(config).__name__ if config is not None else type(patcher.model).__name__


def reference_tree(patcher) -> tuple[torch.nn.Module, Spans] | None:
    """(diffusers tree on meta at this model's widths, spans to ComfyUI's original rows), or None when
    loraweave has no reference for this ComfyUI model (its keys then resolve by ComfyUI's own names only)."""
    found = _reference(patcher)
    return (found[0].tree, found[1]) if found is not None else None


def _same_names(tree: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> tuple[Spans, int] | None:
    """Empty spans (names map to themselves) where ComfyUI keeps the diffusers names (Qwen-Image): at least
    half the tree's tensors are present under the same names, every present one with the same shape."""
    own = {k: tuple(v.shape) for k, v in tree.state_dict().items()}
    present = [k for k in own if k in shapes]
    if not own or len(present) < len(own) / 2 or any(shapes[k] != own[k] for k in present):
        return None
    return {}, len(present)


def _side(adapter: Adapter, text_encoders: bool) -> Adapter:
    """The adapter's parts for one side: text-encoder parts, or the rest (with the unparsed keys)."""
    out = copy.copy(adapter)
    out.parts = [p for p in adapter.parts if (p.component in TEXT_ENCODER_NAMES) == text_encoders]
    out.unparsed = [] if text_encoders else list(adapter.unparsed)
    return out


def _no_such_module(pp: PlannedPart | PlannedParam, module: str) -> list[Unmatched]:
    miss = Miss("no_such_module", f"no such module in ComfyUI's model: {module}")
    return [Unmatched(pp.adapter.name, key, miss) for key in pp.part.keys]


def _placed_keys(plan: Plan) -> set[str]:
    parts: list[PlannedPart | PlannedParam] = [*plan.planned, *plan.params]
    return {k for item in parts for k in item.part.keys}


def _original_params(tree: torch.nn.Module) -> dict[str, str]:
    """{live parameter path: original path} from the architecture's parameter aliases (Wan's scale_shift_table
    is ComfyUI's modulation)."""
    found = bare_parameters(tree, type(tree).__name__, dict(tree.named_modules()))
    return {live: original for original, (live, _) in found.items() if live != original}


def _onto_comfy(
    plan: Plan,
    component: str,
    live: torch.nn.Module,
    spans: Spans,
    adapter: Adapter,
    originals: dict[str, str] | None = None,
) -> Plan:
    """The plan with every piece moved to ComfyUI's original module names and rows, under `component`; parts
    point at `adapter` again (the side copy was for resolving only). `originals`: _original_params of the tree
    the plan resolved on, when the caller holds them."""
    names = dict(live.named_modules())
    out = Plan(Components({component: live}), [adapter], plan.strengths, unmatched=list(plan.unmatched))
    for pp in plan.planned:
        pieces = tuple(q for piece in pp.pieces for q in translate(piece, spans))
        missing = next((q.module for q in pieces if q.module not in names), None)
        if missing is not None:
            out.unmatched += _no_such_module(pp, missing)
            continue
        refused = _piece_refusal(pp, pieces, component)
        if refused is not None:
            out.unmatched += [Unmatched(pp.adapter.name, key, refused) for key in pp.part.keys]
            continue
        whole = tuple(dataclasses.replace(q, whole=_covers(names[q.module], q)) for q in pieces)
        grow = {
            q.module: pp.grow[p.module] for p in pp.pieces if p.module in pp.grow for q in translate(p, spans)
        }  # a control adapter's grown input, under ComfyUI's name for the module
        out.planned.append(
            dataclasses.replace(pp, adapter=adapter, component=component, pieces=whole, grow=grow)
        )
    if originals is None:
        originals = _original_params(plan.components.modules[next(iter(plan.components.modules))])
    for param in plan.params:
        owner, _, name = originals.get(param.path, param.path).rpartition(".")
        target = getattr(names.get(owner), name, None)
        if not isinstance(target, torch.nn.Parameter) or target.numel() != param.delta.numel():
            out.unmatched += _no_such_module(param, param.path)
            continue
        delta = param.delta.reshape(target.shape)
        out.params.append(
            dataclasses.replace(
                param, adapter=adapter, component=component, owner=owner, name=name, delta=delta
            )
        )
    return out


def _by_comfy_names(
    plan: Plan, side: Adapter, live: torch.nn.Module, strength: float, adapter: Adapter
) -> Plan:
    """The plan, with the parts none of whose keys landed on the reference tree resolved again on ComfyUI's
    own module names: modules ComfyUI keeps inside its diffusion model that diffusers' transformer lacks
    (LTX-2's text connectors, a pipeline component of their own in diffusers). A name that matches there is
    that module."""
    missed = {u.key for u in plan.unmatched}
    rest = [p for p in side.parts if p.keys and all(k in missed for k in p.keys)]
    if not rest:
        return plan
    again = copy.copy(side)
    again.parts, again.unparsed = rest, []
    second = resolve(Components({"transformer": live}), [(again, strength)])
    second = _onto_comfy(second, DENOISER_PREFIX, live, {}, adapter)
    landed = _placed_keys(second)
    plan.unmatched = [u for u in plan.unmatched if u.key not in landed]
    plan.planned += second.planned
    plan.params += second.params
    return plan


def _inner_components(
    plan: Plan, side: Adapter, live: torch.nn.Module, strength: float, adapter: Adapter
) -> Plan:
    """The plan, with the parts of INNER_COMPONENTS resolved on the submodule ComfyUI keeps them in (names
    below the attribute are the component's own), their pieces moved under that attribute."""
    for component, attr in INNER_COMPONENTS.items():
        inner = getattr(live, attr, None)
        parts = [p for p in side.parts if p.component == component]
        if not isinstance(inner, torch.nn.Module) or not parts:
            continue
        again = copy.copy(side)
        again.parts, again.unparsed = parts, []
        second = resolve(Components({component: inner}), [(again, strength)])
        spans: Spans = {
            name: [(f"{attr}.{name}", 0, 0, rows)]
            for name, module in inner.named_modules()
            if name and (rows := out_rows(module)) is not None
        }
        second = _onto_comfy(second, DENOISER_PREFIX, live, spans, adapter)
        landed = _placed_keys(second)
        plan.unmatched = [u for u in plan.unmatched if u.key not in landed]
        plan.planned += second.planned
        plan.params += second.params
    return plan


def _piece_refusal(pp: PlannedPart, pieces: tuple, component: str) -> Miss | None:
    """Why the family cannot take its rows as ComfyUI holds them, or None. A module of the reference tree may
    sit in ComfyUI's model as several row ranges (Flux/SD3 final layers: shift and scale halves swapped), and
    a family whose ΔW reads all of the module's rows at once (input-axis DoRA's column norm) cannot take them
    range by range: refused here, named in the report, instead of failing inside ComfyUI's patching."""
    for q in pieces:
        reason = pp.family.check_piece(pp.factors, q.src_start, q.length)
        if reason is not None:
            return reason.where(f"{component}.{q.module}")
    return None


def _covers(module: torch.nn.Module, piece) -> bool:
    weight = getattr(module, "weight", None)
    return weight is not None and piece.dst_start == 0 and piece.length == weight.shape[0]


def _refuse_strict(plan: Plan, strict: bool, what: str) -> None:
    if strict and failures(plan.unmatched):
        refuse_strict(make_report(plan, "merge", [], plan.unmatched, 0.0), strict, f"ComfyUI's {what}")


def plan_for_patcher(
    patcher,
    adapter: Adapter,
    strength: float = 1.0,
    strict: bool = False,
    modality_strengths: dict[str, float] | None = None,
) -> Plan:
    """A loraweave Plan of `adapter`'s denoiser keys on ComfyUI's diffusion model (component
    `diffusion_model`: pieces name its modules and rows). Text-encoder keys are left to `plan_for_clip`.
    `modality_strengths` (checked by the caller) scales each part by its module's modality, as the
    architecture declares them on ComfyUI's names (ArgumentError where it declares none). Nothing is
    modified."""
    side = _side(adapter, text_encoders=False)
    live = patcher.model.diffusion_model
    arch = comfy_arch(patcher)
    found, why = reference_or_why(patcher)
    if found is None:
        plan = resolve(Components({"transformer": live}), [(side, strength)])
        plan = _onto_comfy(plan, DENOISER_PREFIX, live, {}, adapter)
        if arch is not None and why is not None:  # a mapped architecture without its reference: say why
            plan.unmatched = [dataclasses.replace(u, miss=u.miss.where(why)) for u in plan.unmatched]
    else:
        ref, spans = found
        plan = resolve(Components({ref.component: ref.tree}), [(side, strength)], {ref.component: ref.table})
        plan = _onto_comfy(plan, DENOISER_PREFIX, live, spans, adapter, ref.originals)
        plan = _by_comfy_names(plan, side, live, strength, adapter)
    plan = _inner_components(plan, side, live, strength, adapter)
    if modality_strengths:
        facet = modalities_named(arch, modality_strengths, "modality_strengths")
        weigh_modalities([*plan.planned, *plan.params], facet, modality_strengths)
    log.info(
        "comfy plan side=model arch=%s planned=%d params=%d unmatched=%d",
        arch,
        len(plan.planned),
        len(plan.params),
        len(plan.unmatched),
    )
    _refuse_strict(plan, strict, "diffusion model")
    return plan


def clip_encoders(clip) -> dict[str, tuple[str, torch.nn.Module]]:
    """{loraweave component: (ComfyUI state-dict prefix, module)} of a ComfyUI CLIP's text encoders."""
    root = clip.cond_stage_model
    found = [
        (n, m.transformer)
        for n, m in root.named_children()
        if isinstance(getattr(m, "transformer", None), torch.nn.Module)
    ]
    found.sort(
        key=lambda item: ENCODER_ORDER.index(item[0]) if item[0] in ENCODER_ORDER else len(ENCODER_ORDER)
    )
    return {
        comp: (f"{name}.transformer", module)
        for comp, (name, module) in zip(TEXT_ENCODER_NAMES, found, strict=False)
    }


def plan_for_clip(clip, adapter: Adapter, strength: float = 1.0, strict: bool = False) -> Plan:
    """A loraweave Plan of `adapter`'s text-encoder keys on a ComfyUI CLIP: components are the CLIP patcher's
    state-dict prefixes (`clip_l.transformer`, ...), pieces its modules. Nothing is modified."""
    side = _side(adapter, text_encoders=True)
    encoders = clip_encoders(clip)
    if not encoders:
        raise TargetError(
            f"ComfyUI CLIP {type(clip.cond_stage_model).__name__} holds no text encoder modules"
        )
    plan = resolve(Components({comp: module for comp, (_, module) in encoders.items()}), [(side, strength)])
    out = Plan(
        Components({prefix: module for prefix, module in encoders.values()}),
        [adapter],
        plan.strengths,
        unmatched=list(plan.unmatched),
    )
    out.planned = [
        dataclasses.replace(pp, adapter=adapter, component=encoders[pp.component][0]) for pp in plan.planned
    ]
    out.params = [
        dataclasses.replace(p, adapter=adapter, component=encoders[p.component][0]) for p in plan.params
    ]
    _refuse_strict(out, strict, "CLIP")
    return out


def is_denoiser_component(name: str) -> bool:
    return name == DENOISER_PREFIX or name in DENOISER_NAMES
