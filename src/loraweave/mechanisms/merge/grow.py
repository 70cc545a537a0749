"""Growing a model input for control adapters (BFL Canny/Depth: Flux `x_embedder` 64 -> 128 columns).

The module keeps its identity; its weight becomes a zero-padded wider Parameter (new channels start with no
effect), `in_features` and the model config's input width follow. Undo puts the original Parameter object,
`in_features` and config values back, so the model is exactly as before."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("loraweave")


@dataclass(eq=False)
class GrownInput:
    module: torch.nn.Linear
    weight: torch.Tensor  # the original Parameter object
    in_features: int
    config_owner: object | None
    config_before: dict[str, object] = field(default_factory=dict)
    adapters: frozenset[str] = (
        frozenset()
    )  # a journal entry's adapters: growth belongs to none (strengths skip it)

    def restore(self) -> None:
        self.module.weight = self.weight
        self.module.in_features = self.in_features
        for key, value in self.config_before.items():
            _set_config(self.config_owner, key, value)

    undo = restore  # a journal entry


def _set_config(owner: Any, key: str, value: object) -> None:  # a model with a `config`
    register = getattr(owner, "register_to_config", None)
    if register is not None:  # diffusers models: a frozen config rebuilt by register_to_config
        register(**{key: value})
    else:
        setattr(owner.config, key, value)


def grow_input(
    root: torch.nn.Module,
    path: str,
    width: int,
    config_key: str,
    record: Callable[[GrownInput], object] | None = None,
) -> GrownInput:
    """Widen Linear `root.<path>` to `width` input columns (zeros); `record(entry)` gets the undo record
    before anything changes."""
    module = root.get_submodule(path)
    old = module.weight
    if not isinstance(module, torch.nn.Linear) or not isinstance(old, torch.Tensor) or width <= old.shape[1]:
        shape = tuple(old.shape) if isinstance(old, torch.Tensor) else old
        raise ValueError(f"cannot grow {path} ({type(module).__name__}, weight {shape}) to {width} columns")
    config = getattr(root, "config", None)
    before: dict[str, object] = {}
    if config is not None and hasattr(config, config_key):
        before[config_key] = getattr(config, config_key)
        if hasattr(config, "out_channels") and config.out_channels is None:
            before["out_channels"] = (
                None  # diffusers derives out_channels from in_channels when unset: pin it
            )
    grown = GrownInput(module, old, module.in_features, root if before else None, before)
    if record is not None:
        record(grown)
    wider = torch.zeros(old.shape[0], width, dtype=old.dtype, device=old.device)
    wider[:, : old.shape[1]] = old.detach()
    module.weight = torch.nn.Parameter(wider, requires_grad=old.requires_grad)
    module.in_features = width
    if before:
        if "out_channels" in before:
            _set_config(root, "out_channels", getattr(root, "out_channels", before[config_key]))
        _set_config(root, config_key, width)
    log.info("grow module=%s in=%d->%d config=%s", path, old.shape[1], width, config_key if before else "-")
    return grown
