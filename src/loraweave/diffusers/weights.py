"""`set_adapters` weights, as diffusers 0.42.1 reads them: per adapter, per component, per module.

A weight may be a float (every component), None (1.0), a per-component dict (a missing component gets 1.0), a
list with one entry per name, or, for UNets, a nested block-scale dict expanded by diffusers' own expansion
function. Per module, a dict weight is matched as diffusers does: the first key that is a substring of the
module name, else the `down_blocks.i.attentions.j` key of that module, else 1.0."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

from ..errors import DropInError

log = logging.getLogger("loraweave")


def _expansion(model) -> Any:
    """diffusers' own block-scale expansion for this model class (identity for all but UNets)."""
    try:
        from diffusers.loaders.peft import _SET_ADAPTER_SCALE_FN_MAPPING
    except ImportError:  # a diffusers without it has no block-scale dicts either
        return lambda _model, weights: weights
    return _SET_ADAPTER_SCALE_FN_MAPPING[type(model).__name__]


def _drop_unknown_components(weights: dict, loadable: list[str]) -> dict:
    invalid = sorted(set(weights) - set(loadable))
    if invalid:
        log.warning(
            "loraweave.diffusers set_adapters ignores components=%s (not LoRA-loadable; loadable=%s)",
            invalid,
            loadable,
        )
    return {k: v for k, v in weights.items() if k not in invalid}


def component_weights(
    names: list[str], weights: Any, models: dict, loadable: list[str], components_of: dict[str, list[str]]
) -> dict[str, dict[str, Any]]:
    """{component: {adapter: weight}} for every present loadable component; raises diffusers' errors.

    models: the present loadable components (name -> module); components_of: adapter -> its components."""
    if isinstance(weights, dict):
        weights = _drop_unknown_components(weights, loadable)
    weights = copy.deepcopy(weights)
    if not isinstance(weights, list):
        weights = [weights] * len(names)
    if len(names) != len(weights):
        raise DropInError(
            f"Length of adapter names {len(names)} is not equal to the length of the weights {len(weights)}"
        )
    present = set(components_of)
    missing = set(names) - present
    if missing:
        raise DropInError(f"Adapter name(s) {missing} not in the list of present adapters: {present}.")
    out: dict[str, dict[str, Any]] = {}
    for component in loadable:
        model = models.get(component)
        if model is None:
            continue
        per_adapter = []
        for name, w in zip(names, weights, strict=True):
            if isinstance(w, dict):
                w = w.pop(component, None)
                if w is not None and component not in components_of[name]:
                    log.warning(
                        "loraweave.diffusers set_adapters adapter=%s has no weights for component=%s: "
                        "its weight there is ignored",
                        name,
                        component,
                    )
            per_adapter.append(1.0 if w is None else w)
        if not component.startswith("text_encoder"):
            try:
                per_adapter = _expansion(model)(model, per_adapter)
            except ValueError as err:  # diffusers' block-scale errors, typed
                raise DropInError(str(err)) from err
        for name, w in zip(names, per_adapter, strict=True):
            _check_weight(name, component, w)
        out[component] = dict(zip(names, per_adapter, strict=True))
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_weight(name: str, component: str, weight: Any) -> None:
    values = weight.values() if isinstance(weight, dict) else [weight]
    if not all(_number(v) for v in values):
        raise DropInError(
            f"set_adapters: the weight of adapter {name!r} on {component} must be a finite number "
            f"(or, for UNets, a block-scale dict), got {weight!r}"
        )


def module_weight(weight: Any, module_name: str) -> float:
    """The weight one module gets from an adapter's (expanded) weight, by diffusers' matching rule.

    Deliberate difference: a module name with fewer than four parts falls back to 1.0 where diffusers raises
    IndexError (e.g. `x_embedder` under a block dict on a DiT)."""
    if not isinstance(weight, dict):
        return float(weight)
    for key, value in weight.items():
        if key in module_name:
            return float(value)
    parts = module_name.split(".")
    if len(parts) < 4:
        return 1.0
    return float(weight.get(f"{parts[0]}.{parts[1]}.attentions.{parts[3]}", 1.0))
