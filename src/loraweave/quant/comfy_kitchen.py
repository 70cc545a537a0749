"""Layers whose weight is a `comfy_kitchen` QuantizedTensor (ComfyUI's fp8 / NVFP4 / MXFP8 / INT8 / ConvRot
W4A4 / W4A8 checkpoints: `comfy_quant` metadata, "fp8_scaled" files).

What loraweave reads of them goes through the tensor's own API: `dequantize()` (the layout's inverse, in the
original basis: ConvRot's Hadamard rotation undone) and the tensor flatten protocol (`__tensor_flatten__`:
the stored tensors, scales included, and the layout's name). Nothing is written: ComfyUI requantizes through
its own patch path (the ComfyUI pack's merge), so requantize and side channels are declared absent, and a
runtime path sits beside the layer."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .backend import Capabilities, QuantBackend

# Bits per stored weight by layout (matched along the layout class's MRO, so ComfyUI's subclasses count).
LAYOUT_BITS = {
    "TensorCoreFP8Layout": 8,
    "TensorCoreMXFP8Layout": 8,
    "TensorWiseINT8Layout": 8,
    "TensorCoreNVFP4Layout": 4,
    "TensorCoreConvRotW4A4Layout": 4,
    "AsymW4A8Int8Layout": 4,
    "TensorCoreSVDQuantW4A4Layout": 4,
    "TensorCoreAWQW4A16Layout": 4,
}
NO_WRITE = "ComfyUI requantizes comfy_kitchen layouts through its own patch path: merge there (ComfyUI pack)"


def is_quantized_tensor(tensor: object) -> bool:
    """Whether `tensor` is a comfy_kitchen QuantizedTensor (by class, so comfy_kitchen is never imported)."""
    cls = type(tensor)
    return cls.__name__ == "QuantizedTensor" and cls.__module__.startswith("comfy_kitchen")


def layout_name(tensor: Any) -> str:
    """The layout a QuantizedTensor names (registered or not), read through the flatten protocol."""
    return str(tensor.__tensor_flatten__()[1]["layout_cls"])


def layout_class(tensor: Any) -> type | None:
    """The layout class comfy_kitchen registers under the tensor's layout name, or None (unknown layout)."""
    from comfy_kitchen.tensor import get_layout_class

    try:
        return get_layout_class(layout_name(tensor))
    except KeyError:
        return None


def stored_tensors(tensor: Any) -> dict[str, torch.Tensor]:
    """{name: tensor} of everything a QuantizedTensor stores: its data and every tensor of its params."""
    names, _ = tensor.__tensor_flatten__()
    return {name: getattr(tensor, name) for name in names}


def bits_of(layout: type) -> int:
    for cls in layout.__mro__:
        if cls.__name__ in LAYOUT_BITS:
            return LAYOUT_BITS[cls.__name__]
    return 8


@functools.cache
def _missing() -> str | None:
    try:
        import comfy_kitchen.tensor  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported, never fatal
        return f"comfy_kitchen not importable: {type(exc).__name__}: {exc}"
    return None


class ComfyKitchenBackend(QuantBackend):
    name = "comfy_kitchen"

    def unavailable(self) -> str | None:
        return _missing()

    def owns(self, module: torch.nn.Module) -> bool:
        return is_quantized_tensor(module.__dict__.get("_parameters", {}).get("weight"))

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        readable = layout_class(module.weight) is not None
        why = "" if readable else f"unknown layout {layout_name(module.weight)!r}; {NO_WRITE}"
        return Capabilities(
            dequantize=readable, requantize=False, factor_channel=False, reason=why or NO_WRITE
        )

    def bits(self, module: torch.nn.Module) -> int:
        layout = layout_class(module.weight)
        return bits_of(layout) if layout is not None else 8

    def logical_shape(self, module: torch.nn.Module) -> tuple[int, ...] | None:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return tuple(weight.shape)  # the tensor reports its original (unpadded) shape

    def grid_step(self, module: torch.nn.Module) -> float:
        w = self.dequantize(module)
        return float(w.abs().amax()) * 2 / (2 ** self.bits(module) - 1)

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        weight: Any = module.weight
        return weight.dequantize().to(torch.float32)


BACKEND = ComfyKitchenBackend()
