"""diffusers drop-in: `enable(pipe)` routes the pipeline's own LoRA methods through loraweave; no PEFT needed.

After `loraweave.diffusers.enable(pipe)`: `load_lora_weights`, `set_adapters`, `get_active_adapters`,
`get_list_adapters`, `delete_adapters`, `enable_lora`, `disable_lora`, `fuse_lora`, `unfuse_lora`,
`unload_lora_weights` and per-call `joint_attention_kwargs={"scale": s}` / `cross_attention_kwargs` follow
diffusers 0.42.1's semantics and errors (same ValueError messages, as `DropInError`), with any layout or
family loraweave reads (LoHa, LoKr everywhere, full diffs, kohya/ComfyUI/ai-toolkit names, ...). Each load's
report is `pipe.loraweave_reports[name]`. `disable(pipe)` unloads the adapters and puts diffusers' methods
back.

Deliberate differences from diffusers, where diffusers is defective:
- unfuse_lora restores the weights bit-exactly (diffusers subtracts ΔW at the current scaling: drift after a
  set_adapters or in half precision);
- fuse_lora(lora_scale=s) scales only the fused weights (diffusers leaves every active adapter scaled by s);
- fusing some adapters keeps the other active adapters running (PEFT skips every unfused adapter on a layer
  that holds a merged one);
- fusing never writes non-finite weights (`safe_fusing` is always on; the layer is left as it was);
- a per-call scale of 0 restores the weights set before the call (diffusers resets them to 1);
- a block-weight dict never raises IndexError on short module names (they get 1.0);
- disable_lora unfuses at once and says so in `fused_loras` (PEFT unmerges lazily, on the next forward).
Unsupported (raise `UnsupportedError`): hotswap loads, `enable_lora_hotswap`, `set_lora_device`, and the
model-level LoRA methods (`pipe.unet.set_adapters`, ...), which would otherwise silently do nothing.

Simplifications (diffusers' per-layer bookkeeping kept per component): an unnamed load's `default_{n}` is
counted in the first component holding LoRA layers (diffusers counts per component, so a text-encoder-only
adapter may get another name there); after deleting an active adapter the first remaining one in that
component becomes active (PEFT decides per layer); an adapter name may not be reused in any component; under a
block-scale dict a fused kohya part spanning several modules (e.g. a fused qkv) takes its first module's
weight; deleting a fused adapter while other adapters are fused in the same component raises `DropInError`
(unfuse first, or unload to keep every fused delta), since undoing the others would also drop its kept delta.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, TypeVar

import torch

from ..errors import DropInError, NotLoraPipelineError, UnsupportedError
from .scale import hook_denoiser, wrap_encode_prompt
from .state import DropIn

log = logging.getLogger("loraweave")
ATTR = "_loraweave_dropin"
METHODS = (
    "load_lora_weights",
    "set_adapters",
    "get_active_adapters",
    "get_list_adapters",
    "delete_adapters",
    "enable_lora",
    "disable_lora",
    "fuse_lora",
    "unfuse_lora",
    "unload_lora_weights",
    "enable_lora_hotswap",
    "set_lora_device",
)

# diffusers' model-level LoRA methods: with PEFT installed and no PEFT layers they would silently do nothing.
MODEL_METHODS = (
    "load_lora_adapter",
    "set_adapters",
    "set_adapter",
    "add_adapter",
    "fuse_lora",
    "unfuse_lora",
    "unload_lora",
    "enable_lora",
    "disable_lora",
    "delete_adapters",
    "enable_adapters",
    "disable_adapters",
    "enable_lora_hotswap",
)
Pipe = TypeVar("Pipe")

__all__ = ["DropInError", "NotLoraPipelineError", "UnsupportedError", "disable", "enable"]


def _default(pipe, method: str) -> list[str] | None:
    params = inspect.signature(getattr(type(pipe), method)).parameters
    value = params["components"].default if "components" in params else None
    return None if value is inspect.Parameter.empty else value


def _peft_layers(pipe, loadable: list[str]) -> list[str]:
    found = []
    for component in loadable:
        model = getattr(pipe, component, None)
        if isinstance(model, torch.nn.Module):
            found += [
                f"{component}.{n}" for n, m in model.named_modules() if type(m).__module__.startswith("peft.")
            ]
    return found


def _model_method_guard(component: str, method: str):
    def refuse(*args, **kwargs):
        raise UnsupportedError(
            f"pipe.{component}.{method}() bypasses loraweave.diffusers: call pipe.{method}() "
            "(pipeline level) or use loraweave.apply on the model"
        )

    return refuse


def _guard_models(dropin: DropIn) -> list[tuple[torch.nn.Module, str]]:
    guarded = []
    for component, model in dropin.models().items():
        for method in MODEL_METHODS:
            if callable(getattr(type(model), method, None)):
                model.__dict__[method] = _model_method_guard(component, method)
                guarded.append((model, method))
    return guarded


def enable(pipe: Pipe) -> Pipe:
    """Route `pipe`'s LoRA methods through loraweave; returns `pipe`. Idempotent."""
    if getattr(pipe, ATTR, None) is not None:
        return pipe
    loadable = list(getattr(type(pipe), "_lora_loadable_modules", None) or [])
    if not loadable or not callable(getattr(type(pipe), "load_lora_weights", None)):
        raise NotLoraPipelineError(f"{type(pipe).__name__} is not a diffusers pipeline with LoRA loading")
    peft = _peft_layers(pipe, loadable)
    if peft:
        raise NotLoraPipelineError(
            f"{type(pipe).__name__} already holds {len(peft)} PEFT LoRA layers "
            f"(e.g. {peft[0]}): call pipe.unload_lora_weights() before enable()"
        )
    dropin = DropIn(pipe, _default(pipe, "fuse_lora"), _default(pipe, "unfuse_lora"))
    hooks = []
    for component, model in dropin.models().items():
        if not component.startswith("text_encoder"):
            hooks += hook_denoiser(dropin, component, model)
    dropin.hooks = hooks
    dropin.guarded = _guard_models(dropin)
    for name in METHODS:
        setattr(pipe, name, getattr(dropin, name))
    encode = wrap_encode_prompt(dropin, pipe)
    dropin.wrapped_encode = encode is not None
    patched: Any = pipe  # any diffusers pipeline: the drop-in adds attributes of its own
    if encode is not None:
        patched.encode_prompt = encode
    patched.loraweave_reports = dropin.reports
    setattr(pipe, ATTR, dropin)
    log.info("loraweave.diffusers enabled pipeline=%s components=%s", type(pipe).__name__, ",".join(loadable))
    return pipe


def disable(pipe: Pipe) -> Pipe:
    """Unload loraweave's adapters (fused deltas stay, as with diffusers' unload) and restore diffusers'
    methods."""
    dropin = getattr(pipe, ATTR, None)
    if dropin is None:
        return pipe
    dropin.unload_lora_weights()
    for hook in dropin.hooks:
        hook.remove()
    for model, method in dropin.guarded:
        model.__dict__.pop(method, None)
    names = [*METHODS, "loraweave_reports", ATTR] + (["encode_prompt"] if dropin.wrapped_encode else [])
    for name in names:
        pipe.__dict__.pop(name, None)
    log.info("loraweave.diffusers disabled pipeline=%s", type(pipe).__name__)
    return pipe
