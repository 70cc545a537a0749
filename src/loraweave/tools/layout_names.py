"""The names an output layout (kohya, peft, diffusers, comfy) gives the modules a resolved adapter lands on:
which components use original (ldm/BFL) names, each target's stem, and where every planned row lands."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arch.aliases import missing_file_prefix
from ..errors import ConvertError
from ..formats.adapter import Adapter
from ..formats.keys import component_prefix
from ..resolve.planner import PlannedPart
from ..resolve.target import Components, as_components
from .remap import Spans, original_spans

Pair = tuple[torch.Tensor, torch.Tensor, float]  # (down (r, in, *k), up (rows, r), alpha) of one part


def uses_original_names(layout: str, component: str, module: torch.nn.Module) -> bool:
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
    if not uses_original_names(layout, "denoiser" if denoiser else comp, module):
        return {}, {}
    return original_spans(module)


@dataclass(frozen=True)
class Span:
    """Rows [lo, hi) of a planned piece land on rows [row, row + hi - lo) of target `name` (`total` rows),
    read from the part's rows from `src`."""

    pp: PlannedPart
    component: str
    name: str
    total: int
    row: int
    src: int
    length: int


def target_spans(plan, layout: str) -> list[Span]:
    """Where every planned piece's rows land under the names layout `layout` writes."""
    out: list[Span] = []
    namings = {c: _naming(layout, c, m, c == plan.components.denoiser_name) for c, m in plan.components}
    # CLIP layers under `text_model.` as every trainer writes them, even where this tree lacks it
    prefixes = {c: missing_file_prefix(m) for c, m in plan.components}
    for pp in plan.planned:
        for piece in pp.pieces:
            module = plan.components.modules[pp.component].get_submodule(piece.module)
            rows = module.weight.shape[0]
            named, totals = namings[pp.component]
            spans = named.get(piece.module) or [(prefixes[pp.component] + piece.module, 0, 0, rows)]
            for name, t_start, m_start, length in spans:
                lo = max(piece.dst_start, m_start)
                hi = min(piece.dst_start + piece.length, m_start + length)
                if lo < hi:
                    src = piece.src_start + (lo - piece.dst_start)
                    row = t_start + lo - m_start
                    out.append(Span(pp, pp.component, name, totals.get(name, rows), row, src, hi - lo))
    return out


def target_stem(
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


def target_components(adapter: Adapter, target, arch: str | None, model: str | None) -> Components:
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
