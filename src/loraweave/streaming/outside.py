"""Tensors quantized layers keep outside their parameters and buffers: streaming cannot move them, so it
counts them as resident (bitsandbytes 4-bit `quant_state`) or refuses the layer (bitsandbytes int8)."""

from __future__ import annotations

import torch

from ..errors import ArgumentError


def _state_tensors(state, seen: set[int]) -> list[torch.Tensor]:
    """Every tensor of a bitsandbytes QuantState, nested state included."""
    if state is None or id(state) in seen:
        return []
    seen.add(id(state))
    out = []
    for value in vars(state).values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif type(value).__name__ == "QuantState":
            out += _state_tensors(value, seen)
    return out


def resident_outside_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """Device bytes of tensors held outside parameters/buffers that stay where they are while the weights
    stream.

    Raises ArgumentError (a ValueError) for layers that cannot be streamed at all, or whose side tensors are
    not on `device`."""
    total, seen = 0, set[int]()
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is None:
            continue
        if type(weight).__name__ == "Int8Params":
            raise ArgumentError(
                f"model: {name or type(model).__name__}: bitsandbytes int8 layers keep their int8 matrix in "
                f"`layer.state` "
                "(CB/SCB) and point the weight back at it in every forward, so streaming cannot move it; "
                "quantize "
                "the model with SDNQ, GGUF, optimum-quanto, torchao or bitsandbytes 4-bit to stream it"
            )
        for t in _state_tensors(getattr(weight, "quant_state", None), seen):
            if t.device != device:
                raise ArgumentError(
                    f"model: {name}: bitsandbytes 4-bit quant_state is on {t.device}, the compute device is "
                    f"{device}: "
                    "quantize on the compute device (model.to(device)) before streaming; streaming moves the "
                    "packed weights, the small quant_state stays on the device"
                )
            total += t.numel() * t.element_size()
    return total
