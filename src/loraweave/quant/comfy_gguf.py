"""GGUF layers as ComfyUI-GGUF loads them: a GGMLOps layer whose weight is a `GGMLTensor` (the GGML blocks as
uint8, the logical shape in `tensor_shape`, the type in `tensor_type`).

The layer dequantizes in its own `get_weight` on every forward (and applies ComfyUI's patch list there), so a
dequantize here is that very call: the weight the layer computes with. ComfyUI-GGUF never writes GGML blocks
back (no requantize), and has no low-rank side branch. Known by duck type (the attributes above and a
`get_weight` method): ComfyUI-GGUF is a custom node, imported by ComfyUI under its folder's name."""

from __future__ import annotations

import math
from typing import Any

import torch

from .backend import Capabilities, QuantBackend, Restore

UNQUANTIZED = ("F32", "F16", "BF16")


def _type_name(weight: Any) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(int(weight.tensor_type)).name


def storage_problem(weight: Any) -> str | None:
    """Why the GGML blocks of `weight` cannot hold its declared type and shape, or None."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(int(weight.tensor_type))
    except ValueError:
        return f"unknown GGML type {weight.tensor_type!r}"
    block, type_size = GGML_QUANT_SIZES[qtype]
    shape = tuple(int(d) for d in weight.tensor_shape)
    numel = math.prod(shape)
    stored = torch.Tensor(weight).numel() * weight.element_size()
    if numel % block:
        return f"{qtype.name} shape {shape}: {numel} values are no whole number of {block}-value blocks"
    expected = numel // block * type_size
    if stored != expected:
        return (
            f"{qtype.name} shape {shape} needs {expected} bytes ({numel // block} blocks of {type_size}), "
            f"the tensor holds {stored}"
        )
    return None


class ComfyGGUFBackend(QuantBackend):
    name = "comfy_gguf"

    def owns(self, module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return (
            type(weight).__name__ == "GGMLTensor"
            and getattr(weight, "tensor_type", None) is not None
            and callable(getattr(module, "get_weight", None))
        )

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        return Capabilities(True, False, False, "ComfyUI-GGUF keeps the GGML blocks read-only: no requantize")

    def bits(self, module: torch.nn.Module) -> int:
        name = _type_name(module.weight)
        if name in UNQUANTIZED:
            return 32 if name == "F32" else 16
        digits = name.lstrip("IQTMXNVFP")[:1]  # Q4_K -> 4, IQ4_XS -> 4, Q8_0 -> 8
        if not digits.isdigit():
            raise ValueError(f"bits unknown for GGUF {name}")
        return int(digits)

    def weight_dtype(self, module: torch.nn.Module) -> torch.dtype:
        """The torch dtype of an unquantized (F32/F16/BF16) row; uint8 for GGML blocks."""
        weight: Any = module.weight
        return weight.dtype

    def logical_shape(self, module: torch.nn.Module) -> tuple[int, ...] | None:
        weight: Any = module.weight
        return tuple(int(d) for d in weight.tensor_shape)

    def malformed(self, module: torch.nn.Module) -> str | None:
        return storage_problem(module.weight)

    def grid_step(self, module: torch.nn.Module) -> float:
        # the range of each 16-value run over the type's level count: one estimate for every type
        w = self.dequantize(module).reshape(-1, 16)
        return float(((w.amax(1) - w.amin(1)) / (2 ** self.bits(module) - 1)).mean())

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        get_weight: Any = module.get_weight  # ComfyUI-GGUF's GGMLLayer.get_weight(tensor, dtype)
        return get_weight(module.weight, torch.float32).detach()

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        raise NotImplementedError("ComfyUI-GGUF keeps the GGML blocks read-only: no requantize")


BACKEND = ComfyGGUFBackend()
