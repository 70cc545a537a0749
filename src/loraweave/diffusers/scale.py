"""Per-call scale: `joint_attention_kwargs={"scale": s}` (or attention_/cross_attention_kwargs) on a
denoiser's forward, and `encode_prompt(lora_scale=s)` for the text encoders, scale every active adapter for
that call only.

Deliberate difference: diffusers resets set_adapters weights to 1 after a call with scale 0; here the weights
before the call are always restored."""

from __future__ import annotations

import functools
import inspect

SCALE_KWARGS = ("joint_attention_kwargs", "attention_kwargs", "cross_attention_kwargs")


def scale_kwarg(model) -> str | None:
    """The forward kwarg diffusers reads `scale` from on this model, if any."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in SCALE_KWARGS if name in params), None)


def hook_denoiser(dropin, component: str, model) -> list:
    """Pre/post forward hooks that set and reset the component's call scale; returns their removable
    handles."""
    kwarg = scale_kwarg(model)
    if kwarg is None:
        return []

    def before(_module, _args, kwargs):
        attention = kwargs.get(kwarg)  # diffusers' apply_lora_scale reads keyword arguments only
        scale = attention.get("scale", 1.0) if isinstance(attention, dict) else 1.0
        if scale != 1.0:
            dropin.set_call_scale([component], scale)

    def after(_module, _args, _output):
        if dropin.call_scale.get(component, 1.0) != 1.0:
            dropin.set_call_scale([component], 1.0)

    return [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, always_call=True),
    ]


def wrap_encode_prompt(dropin, pipe):
    """pipe.encode_prompt with `lora_scale` applied to the text encoders' adapters for the call, or None."""
    original = getattr(pipe, "encode_prompt", None)
    if original is None or "lora_scale" not in inspect.signature(original).parameters:
        return None
    signature = inspect.signature(original)
    encoders = [c for c in dropin.loadable if c.startswith("text_encoder")]

    @functools.wraps(original)
    def encode_prompt(*args, **kwargs):
        scale = signature.bind(*args, **kwargs).arguments.get("lora_scale")
        if scale is None or scale == 1.0:
            return original(*args, **kwargs)
        dropin.set_call_scale(encoders, scale)
        try:
            return original(*args, **kwargs)
        finally:
            dropin.set_call_scale(encoders, 1.0)

    return encode_prompt
