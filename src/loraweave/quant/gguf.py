"""GGUF layers as loaded by diffusers: `GGUFLinear` holding a `GGUFParameter` (raw GGML blocks, uint8 rows).

diffusers dequantizes on every forward (`dequantize_gguf_tensor`, then `compute_dtype`), so a dequantize here
is that same tensor. Requantize uses the `gguf` package's quantizers, which cover the legacy types (Q8_0,
Q4_0, ...) but not the K-quants or IQ types: those layers report requantize=False with that reason."""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from .backend import Capabilities, QuantBackend, Restore

log = logging.getLogger("loraweave")

_LEGACY = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # blocks of 32 that open with the f16 step `d`
_BITS = {"BF16": 16, "F16": 16, "F32": 32}


@functools.cache
def _probe() -> str | None:
    """Why GGUF layers cannot run here, or None: a Q8_0 block row through gguf and diffusers' dequantizer."""
    try:
        import numpy as np
        from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor
        from gguf import GGMLQuantizationType, quants
    except Exception as exc:
        return f"gguf / diffusers GGUF support not importable: {type(exc).__name__}: {exc}"
    try:
        data = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
        blocks = quants.quantize(data, GGMLQuantizationType.Q8_0)
        ours = dequantize_gguf_tensor(
            GGUFParameter(torch.from_numpy(blocks), quant_type=GGMLQuantizationType.Q8_0)
        )
        ref = quants.dequantize(blocks, GGMLQuantizationType.Q8_0)
        if float(np.abs(ours.float().numpy() - ref).max()) > 1e-3:
            return "diffusers' GGUF dequantize disagrees with the gguf package on Q8_0"
    except Exception as exc:
        return f"GGUF dequantize does not run on CPU: {type(exc).__name__}: {exc}"
    return None


@functools.cache
def _quantize_blocker(qtype: int) -> str | None:
    """Why the gguf package cannot quantize `qtype`, or None (one super-block row, tried once per type)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    block = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][0]
    try:
        quants.quantize(
            np.linspace(-1, 1, max(block, 256), dtype=np.float32).reshape(1, -1), GGMLQuantizationType(qtype)
        )
    except Exception as exc:  # NotImplementedError for K-quants / IQ types in the Python package
        return f"gguf package cannot quantize {GGMLQuantizationType(qtype).name}: {type(exc).__name__}"
    return None


def _type_name(module: torch.nn.Module) -> str:
    from gguf import GGMLQuantizationType

    weight: Any = module.weight  # a diffusers GGUFParameter: quant_type undeclared
    return GGMLQuantizationType(int(weight.quant_type)).name


def _blocks(module: torch.nn.Module) -> torch.Tensor:
    """The raw bytes as (n_blocks, type_size) uint8."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    weight: Any = module.weight  # a diffusers GGUFParameter: quant_type undeclared
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(weight.quant_type))]
    raw = weight.as_tensor().detach().view(torch.uint8)
    return raw.reshape(-1, type_size)


def _k_steps(name: str, blocks: torch.Tensor) -> torch.Tensor | None:
    """Per sub-block step of the K-quants whose scale layout is simple; None for the others."""
    from diffusers.quantizers.gguf.utils import get_scale_min

    if name in ("Q4_K", "Q5_K"):
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        sc, _ = get_scale_min(blocks[:, 4:16].contiguous())
        return d * sc.float()
    if name == "Q6_K":
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = blocks[:, 208:210].contiguous().view(torch.float16).float()
        return (d * scales).abs()
    return None


class GGUFBackend(QuantBackend):
    name = "gguf"

    def unavailable(self) -> str | None:
        return _probe()

    def owns(self, module: torch.nn.Module) -> bool:
        weight = getattr(module, "weight", None)
        return type(weight).__name__ == "GGUFParameter" and getattr(weight, "quant_type", None) is not None

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        why = _probe()
        if why:
            return Capabilities(False, False, False, why)
        from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

        weight: Any = module.weight  # a diffusers GGUFParameter: quant_type undeclared
        qtype = int(weight.quant_type)
        if qtype not in [int(t) for t in SUPPORTED_GGUF_QUANT_TYPES]:
            return Capabilities(False, False, False, f"diffusers cannot dequantize GGUF {_type_name(module)}")
        blocker = _quantize_blocker(qtype)
        return Capabilities(True, blocker is None, False, blocker or "no low-rank side branch")

    def malformed(self, module: torch.nn.Module) -> str | None:
        """The raw blocks must decode to the layer's (out, in): a hand-built or corrupt GGUFParameter would
        otherwise reach dequantize/requantize with the wrong shape."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        weight: Any = module.weight  # a diffusers GGUFParameter: quant_type undeclared
        try:
            qtype = GGMLQuantizationType(int(weight.quant_type))
        except ValueError:
            return f"unknown GGML type {weight.quant_type!r}"
        block, type_size = GGML_QUANT_SIZES[qtype]
        raw = weight.as_tensor().view(torch.uint8)
        row = int(raw.shape[-1]) if raw.dim() else 0
        if row == 0 or row % type_size:
            return f"GGUF {qtype.name} rows of {row} bytes are no whole number of {type_size}-byte blocks"
        decoded = (*raw.shape[:-1], row // type_size * block)
        want = (getattr(module, "out_features", None), getattr(module, "in_features", None))
        if decoded != want:
            return f"GGUF {qtype.name} blocks decode to {decoded}, the layer is {want}"
        return None

    def bits(self, module: torch.nn.Module) -> int:
        name = _type_name(module)
        if name in _BITS:
            return _BITS[name]
        digits = name.lstrip("IQTMXNVFP")[:1]  # Q4_K -> 4, IQ4_XS -> 4, Q8_0 -> 8
        if not digits.isdigit():
            raise ValueError(f"bits unknown for GGUF {name}")
        return int(digits)

    def grid_step(self, module: torch.nn.Module) -> float:
        name = _type_name(module)
        blocks = _blocks(module)
        if name in _LEGACY:
            return float(blocks[:, :2].contiguous().view(torch.float16).float().abs().mean())
        steps = _k_steps(name, blocks)
        if steps is not None:
            return float(steps.mean())
        # Other types (Q2_K, Q3_K, IQ*): the range of each 16-value run over its level count, a lower bound.
        w = self.dequantize(module).reshape(-1, 16)
        levels = 2 ** self.bits(module) - 1
        log.debug("grid_step backend=gguf type=%s estimate=range_over_levels", name)
        return float(((w.amax(1) - w.amin(1)) / levels).mean())

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

        weight = dequantize_gguf_tensor(module.weight)
        dtype = getattr(module, "compute_dtype", None)
        if dtype is not None:  # the forward computes with the weight cast to compute_dtype
            weight = weight.to(dtype)
        return weight.detach().float()

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        from diffusers.quantizers.gguf.utils import GGUFParameter
        from gguf import GGMLQuantizationType, quants

        old_param: Any = module._parameters["weight"]  # a GGUFParameter (quant_type undeclared)
        qtype = GGMLQuantizationType(int(old_param.quant_type))
        blocker = _quantize_blocker(int(qtype))
        if blocker:
            raise NotImplementedError(blocker)
        blocks = quants.quantize(weight.detach().float().cpu().numpy(), qtype)
        data = torch.from_numpy(blocks).to(old_param.device)
        module._parameters["weight"] = GGUFParameter(
            data, requires_grad=False, quant_type=old_param.quant_type
        )
        log.debug("requantize backend=gguf type=%s shape=%s", qtype.name, tuple(weight.shape))

        def restore() -> None:
            module._parameters["weight"] = old_param

        return restore


BACKEND = GGUFBackend()
