"""Control adapters that grow a model input inside ComfyUI (BFL Flux Canny/Depth: `img_in` 64 -> 128 columns).

The engine decides the growth (engine/install.py `growth`: each grown input once, its width); the pack
supplies ComfyUI's way of changing a weight's shape: a patch first in the key's patch list whose
`calculate_shape` names the wider weight and whose `calculate_weight` zero-pads it, as core's
`reshape_weight` does. ComfyUI then replaces the parameter when it patches and puts the original tensor back
when it unpatches, and its Flux reads the control latent's channels from the patched `img_in` weight
(`model_base.Flux.concat_cond`): ComfyUI's model config is not touched (the config key the engine names is
diffusers'). A merge adds the adapter's ΔW into the padded weight; a runtime path runs on it."""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

import torch

from ..engine.install import growth
from ..errors import TargetError
from ..report.report import AppliedModule
from ..resolve.planner import Plan
from .host import weight_adapter_base

log = logging.getLogger("loraweave")

Shape = tuple[int, int]
# The weight shape of each module loraweave grows, as loaded: while a grown clone is loaded the live weight is
# the wider one, and a later plan on the same model (a re-queued strength change) must see it as loaded.
LOADED: weakref.WeakKeyDictionary[torch.nn.Module, Shape] = weakref.WeakKeyDictionary()


def loaded_shapes(root: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """{state-dict key: shape} of `root`'s tensors as loaded, whatever growth a loaded clone holds now."""
    shapes = {k: tuple(v.shape) for k, v in root.state_dict().items()}
    # ComfyUI-GGUF's layers save a stand-in of their GGML storage: a parameter's `shape` is the logical one
    shapes.update((k, tuple(v.shape)) for k, v in root.named_parameters())
    for name, module in root.named_modules():
        shape = LOADED.get(module)
        if shape is not None:
            shapes[f"{name}.weight" if name else "weight"] = shape
    return shapes


@dataclass(frozen=True)
class GrownWeight:
    """One weight a control adapter grows: its shape as loaded and the wider one."""

    loaded: Shape
    shape: Shape

    @property
    def note(self) -> str:
        return (
            f"input grown {self.loaded[1]} -> {self.shape[1]} columns (zero weights for the control latent's "
            f"channels, which ComfyUI concatenates by this width)"
        )


def grown_inputs(plan: Plan) -> dict[str, GrownWeight]:
    """{ComfyUI weight key: its growth} of every input the plan's control adapters grow: to the width the
    architecture declares (arch/spec.py ModelInput: the latents and one control latent, as ComfyUI's
    Flux.concat_cond feeds it); any other width was refused by the engine before this."""
    found: dict[str, GrownWeight] = {}
    for component, module, width, _ in growth(plan):
        live = plan.components.modules[component].get_submodule(module)
        weight = live.weight
        assert isinstance(weight, torch.Tensor)  # a growable input is a Linear (the planner's growth)
        rows, columns = LOADED.setdefault(live, (int(weight.shape[0]), int(weight.shape[1])))
        found[f"{component}.{module}.weight"] = GrownWeight((rows, columns), (rows, width))
        log.info("comfy grow module=%s.%s in=%d->%d", component, module, columns, width)
    return found


def grow_patches(grown: dict[str, GrownWeight]) -> dict[str, object]:
    """{weight key: patch} for ModelPatcher.add_patches, added before every other patch of the key."""
    cls = grow_class()
    return {key: cls(g.shape) for key, g in grown.items()}


def add_notes(rows: list[AppliedModule], grown: dict[str, GrownWeight]) -> None:
    """Each report row of a grown module says so."""
    for row in rows:
        g = grown.get(f"{row.component}.{row.module}.weight")
        if g is not None and g.note not in row.notes:
            row.notes.append(g.note)


def plan_notes(rows: list[AppliedModule], plan: Plan) -> None:
    """Each report row of the model side carries the notes its planned parts hold (a modality's strength,
    a block moved to another depth)."""
    notes: dict[str, set[str]] = {}
    for pp in plan.planned:
        for piece in pp.pieces:
            notes.setdefault(piece.module, set()).update(pp.notes)
    for param in plan.params:
        notes.setdefault(param.path, set()).update(param.notes)
    for row in rows:
        row.notes += [n for n in sorted(notes.get(row.module, ())) if n not in row.notes]


def padded(weight: torch.Tensor, shape: Shape) -> torch.Tensor:
    """`weight` zero-padded on the right to `shape` (a new tensor), or `weight` itself at that shape."""
    if tuple(weight.shape) == shape:
        return weight
    if weight.dim() != 2 or weight.shape[0] != shape[0] or weight.shape[1] > shape[1]:
        raise TargetError(f"cannot grow a weight of shape {tuple(weight.shape)} to {shape}")
    wider = weight.new_zeros(shape)
    wider[:, : weight.shape[1]] = weight
    return wider


@functools.cache
def grow_class() -> type:
    """The WeightAdapterBase subclass that widens a weight, made on first use (ComfyUI is imported lazily)."""

    class LoraweaveGrownInput(weight_adapter_base()):  # type: ignore[misc]  # ComfyUI's class, untyped
        """Zero columns for a control adapter's new input channels (no effect until a ΔW lands there)."""

        name = "loraweave_grow"

        def __init__(self, shape: Shape) -> None:
            self.shape = shape
            self.loaded_keys: set[str] = set()
            self.weights: list[object] = []

        def calculate_shape(self, key):
            return self.shape

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
            return padded(weight, self.shape)

    return LoraweaveGrownInput
