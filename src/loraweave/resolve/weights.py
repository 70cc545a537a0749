"""Per-part strength: the adapter's strength (its text-encoder strength on text encoders) x its block weight.

Block weights are looked up per module through the architecture's block-slot table (`arch/blocks.py`); text
encoders take the BASE slot, as the A1111 LoRA Block Weight extension does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arch.blocks import block_weights, chain_lengths, detect_block_arch, weights_for_modules
from ..arch.record import Modalities
from ..errors import ArgumentError
from .modality import modalities_for, modality_scale
from .params import PlannedParam
from .planner import Plan, PlannedPart


@dataclass
class AdapterWeights:
    strength: float
    te_strength: float | None = None  # None: text encoders follow `strength`
    block_weights: Any = None  # scalar, vector, slot dict or preset name; None: every block at 1
    component_strengths: dict[str, float] | None = None  # component -> factor (Wan 2.2 experts); absent: 1
    window: Any = None  # plan.schedule.StepWindow: the sampling steps it acts on (Handle.step_schedule)
    modality_strengths: dict[str, float] | None = None  # modality -> factor (audio-video models); absent: 1
    modalities: Modalities | None = None  # the model's modality facet, set by `assign`


def is_text_encoder(component: str) -> bool:
    return component.startswith("text_encoder")


def part_strength(pp: PlannedPart | PlannedParam, weights: AdapterWeights) -> float:
    te_strength = weights.te_strength if is_text_encoder(pp.component) else None
    component = (weights.component_strengths or {}).get(pp.component, 1.0)
    base = weights.strength if te_strength is None else te_strength
    return base * pp.block_weight * component * modality_factor(pp, weights)


def modality_factor(pp: PlannedPart | PlannedParam, weights: AdapterWeights) -> float:
    """The part's modality strength (1 on text encoders and where none was asked for); `assign` has checked
    the model declares modalities."""
    if not weights.modality_strengths or is_text_encoder(pp.component) or weights.modalities is None:
        return 1.0
    return modality_scale(weights.modalities, module_of(pp), weights.modality_strengths)[1]


def module_of(pp: PlannedPart | PlannedParam) -> str:
    return pp.pieces[0].module if isinstance(pp, PlannedPart) else pp.path


def assign(plan: Plan, settings: dict[str, AdapterWeights]) -> None:
    """Set every planned part's block weight and strength from its adapter's settings.

    A block-weight value that fits nothing raises ValueError listing what would fit; modality strengths on a
    model without modalities raise ArgumentError."""
    tables: dict[tuple[str, str], dict[str, float]] = {}
    parts: list[PlannedPart | PlannedParam] = [*plan.planned, *plan.params]
    _modalities(plan, settings)
    for pp in parts:
        w = settings[pp.adapter.name]
        pp.block_weight = 1.0
        if w.block_weights is not None:
            denoiser = plan.components.denoiser_name
            if denoiser is None:
                raise ArgumentError("block weights need a denoiser (unet/transformer) in the target")
            key = (pp.adapter.name, pp.component)
            if key not in tables:
                tables[key] = _component_weights(plan, denoiser, pp.component, w.block_weights)
            table = tables[key]
            pp.block_weight = (
                table.get(pp.pieces[0].module, table.get("", 1.0))
                if not is_text_encoder(pp.component)
                else table[""]
            )
        pp.strength = part_strength(pp, w)
        if w.modality_strengths and w.modalities is not None and not is_text_encoder(pp.component):
            name, scale = modality_scale(w.modalities, module_of(pp), w.modality_strengths)
            pp.notes.append(f"modality {name} x{scale:g}")


def _modalities(plan: Plan, settings: dict[str, AdapterWeights]) -> None:
    """Each adapter's modality facet, from the denoiser's architecture; refused where it has none."""
    for w in settings.values():
        if not w.modality_strengths:
            continue
        denoiser = plan.components.denoiser_name
        if denoiser is None:
            raise ArgumentError("modality_strengths need a denoiser (transformer) in the target")
        w.modalities = modalities_for(
            plan.components.modules[denoiser], w.modality_strengths, "modality_strengths"
        )


def _component_weights(plan: Plan, denoiser: str, component: str, value: Any) -> dict[str, float]:
    model = plan.components.modules[denoiser]
    arch = detect_block_arch(model)
    names = [n for n, _ in model.named_modules()]
    chains = chain_lengths(arch, names)
    base = block_weights(arch, value, chains=chains).get("BASE", 1.0)
    if component != denoiser:
        return {"": base}
    table = weights_for_modules(arch, names, value, chains=chains)
    return {**{k: (base if v is None else v) for k, v in table.items()}, "": base}


def weigh_modalities(
    parts: list[PlannedPart | PlannedParam], modalities: Modalities, wanted: dict[str, float]
) -> None:
    """Multiply each non-text-encoder part's strength by its modality's (for planners that set strengths
    themselves: ComfyUI's), noting it on the part; folded into `block_weight` too, so a strength set later
    as strength x block weight keeps it."""
    for pp in parts:
        if is_text_encoder(pp.component):
            continue
        name, scale = modality_scale(modalities, module_of(pp), wanted)
        pp.strength *= scale
        pp.block_weight *= scale
        pp.notes.append(f"modality {name} x{scale:g}")
