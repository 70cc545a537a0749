"""One pipeline's LoRA state under the drop-in: loaded adapters, active sets, weights, enabled flag, fuses.

Each loaded adapter is one runtime `Handle` over every LoRA-loadable component. What diffusers expresses with
PEFT scalings is expressed with per-layer gates on those runtime paths: gate = module weight x per-call scale,
and a layer whose adapter is inactive, disabled or fused is detached (the base layer runs untouched). A fuse
is a separate merge `Handle` per (adapter, component), so an unfuse restores the weights bit-exactly."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..api import apply, apply_planned
from ..engine.handle import Handle
from ..errors import ArgumentError, ArgumentTypeError, DropInError, NonFiniteResultError, UnsupportedError
from ..formats.adapter import Adapter, load_adapter
from ..mechanisms.runtime.path import RuntimePath
from ..request.spec import AdapterSpec
from .weights import component_weights, module_weight

log = logging.getLogger("loraweave")
DIFFUSERS_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers prefers in a folder


@dataclass
class Loaded:
    name: str
    adapter: Adapter  # as read, reused by fuses (no second read)
    handle: Handle  # runtime paths over every loadable component
    components: list[str]  # where it landed, in loadable order
    layers: dict[tuple[str, str], RuntimePath] = field(default_factory=dict)  # (component, module) -> path


@dataclass
class Fused:
    name: str
    component: str
    handle: Handle  # merge (or auto on quantized layers); remove() restores bit-exactly


def _source(src, kwargs: dict) -> Any:
    """What diffusers' _fetch_state_dict reads, for local sources: a dict (shallow copy), a file, a folder."""
    if isinstance(src, Mapping):
        return dict(src)
    if not isinstance(src, (str, os.PathLike)):
        raise DropInError(f"load_lora_weights takes a path or a state dict, got {type(src).__name__}")
    path = Path(src)
    if kwargs.get("subfolder"):
        path = path / kwargs["subfolder"]
    if kwargs.get("weight_name"):
        return path / kwargs["weight_name"]
    if path.is_dir() and (path / DIFFUSERS_WEIGHT_NAME).is_file():
        return path / DIFFUSERS_WEIGHT_NAME
    return path


class DropIn:
    """The pipeline's LoRA methods, backed by loraweave handles."""

    def __init__(self, pipe, fuse_default: list[str] | None, unfuse_default: list[str] | None) -> None:
        self.pipe = pipe
        self.loadable = list(type(pipe)._lora_loadable_modules)
        self.fuse_default = list(fuse_default or [])
        self.unfuse_default = list(unfuse_default or [])
        self.loaded: dict[str, Loaded] = {}  # load order
        self.active: dict[str, list[str]] = {}  # component -> active adapter names
        self.weights: dict[
            str, dict[str, Any]
        ] = {}  # component -> adapter -> weight (float or expanded dict)
        self.enabled = True
        self.fused: list[Fused] = []  # fuse order
        self.baked: set[str] = (
            set()
        )  # fused, then deleted/unloaded: the delta stays and diffusers still lists it
        self.call_scale: dict[str, float] = {}  # component -> per-call scale while its forward/encode runs
        self.reports: dict = {}
        self.wrapped: dict[
            str, set[str]
        ] = {}  # component -> layers ever given an adapter since the last unload
        self.hooks: list = []  # enable(): per-call scale hooks on the denoisers
        self.guarded: list[tuple[torch.nn.Module, str]] = []  # enable(): model-level LoRA methods refused
        self.wrapped_encode = False  # enable(): pipe.encode_prompt wrapped for lora_scale

    # ------------------------------------------------------------------ helpers

    def models(self) -> dict[str, torch.nn.Module]:
        return {c: m for c in self.loadable if isinstance(m := getattr(self.pipe, c, None), torch.nn.Module)}

    def _is_fused(self, name: str, component: str) -> bool:
        return any(f.name == name and f.component == component for f in self.fused)

    def gate(self, name: str, component: str, module: str) -> float:
        if not self.enabled or name not in self.active.get(component, ()) or self._is_fused(name, component):
            return 0.0
        weight = self.weights.get(component, {}).get(name, 1.0)
        return module_weight(weight, module) * self.call_scale.get(component, 1.0)

    def refresh(self, components: set[str] | None = None) -> None:
        """Bring every runtime path in line with the state: gate it, or detach it when its gate is 0."""
        for loaded in self.loaded.values():
            for (component, module), path in loaded.layers.items():
                if components is None or component in components:
                    _set_gate(path, loaded.name, self.gate(loaded.name, component, module))

    def set_call_scale(self, components: list[str], scale: float) -> None:
        value = _number(scale, "scale (attention kwargs 'scale' or encode_prompt's lora_scale)")
        for c in components:
            self.call_scale[c] = value
        self.refresh(set(components))

    def _default_name(self) -> str:
        """diffusers' `default_{n}`: n = adapters now on the first layer PEFT would have wrapped (wrappers
        outlive delete_adapters, so that layer may hold none), in the first component that has such layers."""
        for component, model in self.models().items():
            wrapped = self.wrapped.get(component, set())
            first = next((name for name, _ in model.named_modules() if name in wrapped), None)
            if first is not None:
                return f"default_{sum((component, first) in lo.layers for lo in self.loaded.values())}"
        return "default_0"

    def _components_arg(self, components: list[str] | None, default: list[str]) -> list[str]:
        components = default if components is None else components
        if len(components) == 0:
            raise DropInError("`components` cannot be an empty list.")
        for c in components:
            if c not in self.loadable:
                raise DropInError(f"{c} is not found in self._lora_loadable_modules={self.loadable!r}.")
        return list(components)

    def _sync_merged(self) -> None:
        self.pipe._merged_adapters = self.baked | {f.name for f in self.fused}

    # ------------------------------------------------------------------ loading and listing

    def load_lora_weights(
        self,
        pretrained_model_name_or_path_or_dict,
        adapter_name: str | None = None,
        hotswap: bool = False,
        **kwargs,
    ) -> None:
        """diffusers' load_lora_weights through loraweave: every layout and family loraweave reads."""
        if hotswap:
            raise UnsupportedError(
                "load_lora_weights(hotswap=True) is not supported by loraweave.diffusers; "
                "load under a new name or delete the old adapter first"
            )
        adapter = load_adapter(
            _source(pretrained_model_name_or_path_or_dict, kwargs),
            allow_pickle=bool(kwargs.get("allow_pickle", False)),
        )
        name = self._default_name() if adapter_name is None else adapter_name
        if name in self.loaded:
            raise DropInError(
                f"Adapter name {name} already in use in the model - please select a new adapter name."
            )
        handle = apply(
            self.models(), AdapterSpec(adapter, name=name), mode="runtime", allow_empty=True
        )  # refused below as diffusers would
        report = handle.report
        if report.keys_applied == 0:
            handle.remove()
            raise DropInError(
                f"{adapter.path or 'state dict'}: none of the {report.keys_total} keys landed on "
                f"{sorted(self.models())} ({report.reasons() or 'no adapter keys'})"
            )
        landed = {entry.component for entry in report.applied}
        loaded = Loaded(
            name, adapter, handle, [c for c in self.loadable if c in landed], handle.runtime_layers()
        )
        self.loaded[name] = loaded
        for component, module in loaded.layers:
            self.wrapped.setdefault(component, set()).add(module)
        for c in loaded.components:  # diffusers: after a load only the new adapter is active where it landed
            self.active[c] = [name]
            self.weights.setdefault(c, {})[name] = 1.0
        self.refresh(set(loaded.components))
        self.reports[name] = report
        log.info("loraweave.diffusers load adapter=%s %s", name, report.summary())

    def get_list_adapters(self) -> dict[str, list[str]]:
        out = {c: [n for n, lo in self.loaded.items() if c in lo.components] for c in self.loadable}
        return {c: names for c, names in out.items() if names}

    def get_active_adapters(self) -> list[str]:
        """diffusers: the active list of the last LoRA-carrying component."""
        found: list[str] = []
        for c in self.get_list_adapters():
            found = list(self.active.get(c, []))
        return found

    def set_adapters(self, adapter_names: list[str] | str, adapter_weights=None) -> None:
        names = _names(adapter_names)
        components_of = {n: lo.components for n, lo in self.loaded.items()}
        table = component_weights(names, adapter_weights, self.models(), self.loadable, components_of)
        for component, weights in table.items():
            self.active[component] = list(names)
            self.weights.setdefault(component, {}).update(weights)
        self.refresh()

    def delete_adapters(self, adapter_names: list[str] | str) -> None:
        """Unknown names are ignored (diffusers). A fused adapter's delta stays in the weights, as in
        diffusers."""
        names = _names(adapter_names)
        doomed = [n for n in dict.fromkeys(names) if n in self.loaded]
        fused = [f for f in self.fused if f.name in doomed]
        others = sorted(
            {o.name for f in fused for o in self.fused if o.component == f.component and o.name not in doomed}
        )
        if others:  # checked before anything changes: their undo would restore backups without the kept delta
            raise DropInError(
                f"delete_adapters: {sorted({f.name for f in fused})} fused together with {others}; "
                "call unfuse_lora() first, or unload_lora_weights() to keep every fused delta"
            )
        for f in reversed(fused):
            f.handle.keep()
            self.fused.remove(f)
            self.baked.add(f.name)
        for name in doomed:
            self._forget(self.loaded.pop(name))
        self._sync_merged()
        self.refresh()

    def _forget(self, loaded: Loaded) -> None:
        loaded.handle.remove()
        self.reports.pop(loaded.name, None)
        for c in loaded.components:
            self.weights.get(c, {}).pop(loaded.name, None)
            active = self.active.get(c, [])
            if loaded.name in active:
                active.remove(loaded.name)
                if not active:  # PEFT: the first remaining adapter takes over
                    active.extend([n for n, lo in self.loaded.items() if c in lo.components][:1])

    def unload_lora_weights(self) -> None:
        """Remove every adapter. Unfused layers are bit-exactly as before the loads; fused deltas stay
        (diffusers)."""
        for f in reversed(self.fused):
            f.handle.keep()
            self.baked.add(f.name)
        self.fused.clear()
        self._sync_merged()
        for loaded in reversed(self.loaded.values()):
            loaded.handle.remove()
        self.loaded.clear()
        self.active.clear()
        self.weights.clear()
        self.reports.clear()
        self.wrapped.clear()

    # ------------------------------------------------------------------ switching and fusing

    def enable_lora(self) -> None:
        self.enabled = True
        self.refresh()

    def disable_lora(self) -> None:
        """Base outputs while disabled. Fused adapters are unfused first (PEFT unmerges them on the next
        forward)."""
        self._unfuse(set(self.loadable))
        self.enabled = False
        self.refresh()

    def fuse_lora(
        self,
        components: list[str] | None = None,
        lora_scale: float = 1.0,
        safe_fusing: bool = False,
        adapter_names: list[str] | None = None,
        **kwargs,
    ) -> None:
        """Merge the active (or named) adapters at their current weights x lora_scale. Deliberate differences:
        lora_scale scales only the fused weights (diffusers also leaves every active adapter's scaling
        multiplied by it after an unfuse), and a non-finite result is always refused, whatever `safe_fusing`
        says."""
        if not math.isfinite(_number(lora_scale, "lora_scale")):
            raise ArgumentError(f"lora_scale must be a finite number, got {lora_scale!r}")
        components = self._components_arg(components, self.fuse_default)
        if not self.enabled:  # PEFT merges, then unmerges at the next forward while disabled: nothing lasts
            log.warning("loraweave.diffusers fuse_lora ignored: LoRA is disabled (call enable_lora() first)")
            return
        names_arg = [adapter_names] if isinstance(adapter_names, str) else adapter_names
        models = self.models()
        try:
            for component in [c for c in components if c in models]:
                for name in names_arg if names_arg is not None else list(self.active.get(component, [])):
                    loaded = self.loaded.get(name)
                    if (
                        loaded is None
                        or component not in loaded.components
                        or self._is_fused(name, component)
                    ):
                        continue
                    self.fused.append(Fused(name, component, self._merge(loaded, component, lora_scale)))
        # a failed fuse (non-finite result) leaves the earlier ones fused and their runtime paths off
        finally:
            self._sync_merged()
            self.refresh(set(components))

    def _merge(self, loaded: Loaded, component: str, lora_scale: float) -> Handle:
        # The parts the load resolved (factors read, checked and fitted once): nothing is resolved again.
        planned = [pp for pp in loaded.handle.planned if pp.component == component]
        weight = self.weights.get(component, {}).get(loaded.name, 1.0)
        flat = not isinstance(weight, dict)
        strength = (float(weight) if flat else 1.0) * float(lora_scale)
        # loraweave never merges non-finite values: safe_fusing is always on, and the layer is left as it was
        try:
            handle = apply_planned(self.models(), planned, strength, mode="auto")
            if not flat:  # per-module weights (block-scale dicts): each part at its first module's weight
                try:
                    handle.set_part_strengths(
                        lambda pp: module_weight(weight, pp.pieces[0].module) * float(lora_scale)
                    )
                except BaseException:
                    handle.remove()
                    raise
        except NonFiniteResultError as exc:
            raise DropInError(
                f"NaNs detected in the merged weights. The adapter {loaded.name} seems to be broken ({exc})"
            ) from exc
        return handle

    def unfuse_lora(self, components: list[str] | None = None, **kwargs) -> None:
        """Bit-exact: each fuse is undone from its backup. Deliberate difference: diffusers subtracts ΔW at
        the current scaling, so a set_adapters between fuse and unfuse leaves the weights wrong."""
        self._unfuse(set(self._components_arg(components, self.unfuse_default)))

    def _unfuse(self, components: set[str]) -> None:
        for f in [f for f in reversed(self.fused) if f.component in components]:
            f.handle.remove()
            self.fused.remove(f)
        self._sync_merged()
        self.refresh(components)

    # ------------------------------------------------------------------ unsupported

    def enable_lora_hotswap(self, **kwargs) -> None:
        raise UnsupportedError(
            "enable_lora_hotswap is not supported by loraweave.diffusers: strength changes and "
            "set_adapters never rebuild layers; load new adapters under new names"
        )

    def set_lora_device(self, adapter_names, device) -> None:
        raise UnsupportedError(
            "set_lora_device is not supported by loraweave.diffusers: adapter factors follow "
            "their layer's device and dtype at forward time"
        )


def _set_gate(path: RuntimePath, name: str, gate: float) -> None:
    if gate == 0.0:
        if path.active:
            path.detach()
        return
    if path.gates.get(name, 1.0) != gate:
        path.set_gate(name, gate)
    if not path.active:
        path.attach()


def _names(adapter_names) -> list[str]:
    """One name or an iterable of names, as diffusers takes them."""
    if isinstance(adapter_names, str):
        return [adapter_names]
    try:
        return list(adapter_names)
    except TypeError:
        raise ArgumentTypeError(
            f"adapter_names must be a name or a list of names, got {type(adapter_names).__name__}"
        ) from None


def _number(value, label: str) -> float:
    """float(value) (what diffusers takes), with a typed error naming the argument."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"{label} must be a number, got {value!r}") from None
