"""Normalise what the user passes as a target (module, mapping, diffusers pipeline) into named components."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..errors import TargetError
from ..formats.keys import COMPONENT_NAMES, DENOISER, DENOISER_NAMES

# A component a file names but the target lacks -> (component to use instead, required class-name fragment).
COMPONENT_FALLBACKS: dict[str, tuple[tuple[str, str], ...]] = {"text_encoder_3": (("text_encoder_2", "T5"),)}


class Components:
    """Named torch modules; `denoiser` is an alias for the pipeline's unet/transformer."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        if not modules:
            raise TargetError("target holds no torch modules to apply adapters to")
        self.modules = modules
        self.denoiser_name = next((n for n in DENOISER_NAMES if n in modules), None)
        if self.denoiser_name is None and len(modules) == 1:
            self.denoiser_name = next(iter(modules))

    def resolve_name(self, component: str) -> str | None:
        if component == DENOISER:
            return self.denoiser_name
        if component in self.modules:
            return component
        # `lora_te3_` is T5 in SD3 pipelines (text_encoder_3); Flux pipelines hold T5 as text_encoder_2.
        for other, class_hint in COMPONENT_FALLBACKS.get(component, ()):
            if other in self.modules and class_hint in type(self.modules[other]).__name__:
                return other
        return None

    def __iter__(self) -> Iterator[tuple[str, torch.nn.Module]]:
        return iter(self.modules.items())


def as_components(target: Any) -> Components:  # a module, a mapping of them or a pipeline
    if isinstance(target, Components):
        return target
    if isinstance(target, torch.nn.Module):
        # A bare module is the denoiser unless it is clearly a text encoder.
        name = "text_encoder" if "TextModel" in type(target).__name__ else "transformer"
        if type(target).__name__.startswith("UNet"):
            name = "unet"
        return Components({name: target})
    if isinstance(target, Mapping):
        bad = [k for k, v in target.items() if not isinstance(v, torch.nn.Module)]
        if bad:
            raise TargetError(f"target mapping values must be torch modules; not modules: {bad}")
        return Components(dict(target))
    components = getattr(target, "components", None)
    if isinstance(components, Mapping):  # a diffusers DiffusionPipeline
        found = {
            n: m for n, m in components.items() if n in COMPONENT_NAMES and isinstance(m, torch.nn.Module)
        }
        return Components(found)
    raise TargetError(
        f"target: cannot apply adapters to a {type(target).__name__}: pass a torch module, a mapping of "
        "component name -> module, or a diffusers pipeline"
    )


def experts(components: Components, weights: Mapping[str, object]) -> dict[str, tuple[str, ...]]:
    """Adapter name -> denoiser components its denoiser keys land on, from each adapter's
    `component_strengths`.

    Every component named there must exist in the target (a typo must not silently apply nothing)."""
    out: dict[str, tuple[str, ...]] = {}
    for name, w in weights.items():
        named = getattr(w, "component_strengths", None) or {}
        missing = sorted(set(named) - set(components.modules))
        if missing:
            raise TargetError(
                f"component_strengths of {name!r} names {missing}; the target has "
                f"{sorted(components.modules)}"
            )
        denoisers = tuple(c for c in named if c in DENOISER_NAMES)
        if denoisers:
            out[name] = denoisers
    return out
