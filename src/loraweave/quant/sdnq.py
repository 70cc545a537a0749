"""SDNQ (pip `sdnq`): dequantize, requantize with the layer's own config, and the svd_up/svd_down side
channel.

Layouts of the side channel (SDNQ's SVDQuant: svd_up = U·S, svd_down = Vᵀ, dequantized W = dq(q) + svd_up @
svd_down): plain `svd_up (out, r)`, `svd_down (r, in)`; with quantized matmul (forward `(x @ svd_down) @
svd_up`) both are stored transposed; with Hadamard the dequantized weight is rotated back after the side
channel is added, so a factor `A` must be stored as `A·H` (H is block-diagonal, symmetric and
self-inverse)."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from .backend import Capabilities, QuantBackend, Restore

_KEYS = (
    "weight",
    "scale",
    "scale_2",
    "scale_zero_point",
    "zero_point",
    "zero_point_scale",
    "zero_point_2",
    "svd_up",
    "svd_down",
)
_MISSING = object()


def _stash(module: torch.nn.Module, names: tuple[str, ...]) -> Restore:
    """Remember where each attribute lives (parameter, buffer, plain attribute, absent) and its object."""
    saved: list[tuple[str, str, Any]] = []  # (name, where, the object found: parameter, buffer, anything)
    for name in names:
        if name in module._parameters:
            saved.append((name, "param", module._parameters[name]))
        elif name in module._buffers:
            saved.append((name, "buffer", module._buffers[name]))
        else:
            saved.append((name, "dict", module.__dict__.get(name, _MISSING)))

    def restore() -> None:
        for name, where, value in saved:
            module._parameters.pop(name, None)
            module._buffers.pop(name, None)
            module.__dict__.pop(name, None)
            if where == "param":
                module._parameters[name] = value
            elif where == "buffer":
                module._buffers[name] = value
            elif value is not _MISSING:
                module.__dict__[name] = value

    return restore


def _set_tensor(module: torch.nn.Module, name: str, value: torch.Tensor | None, as_param: bool) -> None:
    module._parameters.pop(name, None)
    module.__dict__.pop(name, None)
    if value is not None and as_param:
        module._parameters[name] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module.__dict__[name] = value  # plain attribute, as sdnq stores absent tensors (None)


class SdnqBackend(QuantBackend):
    name = "sdnq"

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("sdnq") is None:
            return "pip package sdnq is not installed"
        return None

    def owns(self, module: torch.nn.Module) -> bool:
        # Class-name check: importing sdnq is heavy and must not happen for float models.
        return hasattr(module, "sdnq_dequantizer") and any(
            c.__name__ == "SDNQLayer" for c in type(module).__mro__
        )

    def _linear(self, module: torch.nn.Module) -> bool:
        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        return deq.layer_class_name == "Linear" and len(deq.original_shape) == 2

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        linear = self._linear(module)
        return Capabilities(
            dequantize=True,
            requantize=True,
            factor_channel=linear,
            reason="" if linear else "sdnq side channel is used only on Linear layers here",
        )

    def bits(self, module: torch.nn.Module) -> int:
        from sdnq.common import dtype_dict

        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        return int(dtype_dict[deq.weights_dtype]["num_bits"])

    def logical_shape(self, module: torch.nn.Module) -> tuple[int, ...] | None:
        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        return tuple(deq.original_shape)

    def has_checkpoint_svd(self, module: torch.nn.Module) -> bool:
        return getattr(module, "svd_up", None) is not None

    def grid_step(self, module: torch.nn.Module) -> float:
        from sdnq.common import dtype_dict

        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        stored_scale = module.scale
        assert isinstance(stored_scale, torch.Tensor)  # SDNQ layers hold their scale as a parameter
        scale = stored_scale.detach().float()
        scale_2 = getattr(module, "scale_2", None)
        if scale_2 is not None:  # two-level scales: the stored scale is itself quantized
            scale = scale * scale_2.detach().float()
        if deq.use_codebook:
            # scale holds the levels (rows/groups x 2^bits): the step is the gap between adjacent levels.
            levels = scale.reshape(-1, scale.shape[-1]).sort(dim=-1).values
            return float(levels.diff(dim=-1).mean())
        info = dtype_dict[deq.weights_dtype]
        if info["is_integer"]:
            return float(scale.abs().mean())
        # Float grids are relative: spacing near |w| is |w|·2^-mantissa.
        return float(self.dequantize(module).abs().mean() * 2.0 ** -int(info["mantissa"]))

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        from sdnq.utils import get_sdnq_params

        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        with torch.no_grad():
            w = deq(
                **get_sdnq_params(module), skip_quantized_matmul=deq.use_quantized_matmul, dtype=torch.float32
            )
        return w.reshape(deq.original_shape).float()

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        """Quantize `weight` as a fresh float tensor with the layer's own settings (never the SDNQ layer
        itself: re-wrapping an SDNQLinear yields a broken layer), then swap the stored tensors in."""
        from sdnq.quantizer import sdnq_quantize_layer_weight

        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        svd_up = getattr(module, "svd_up", None)
        svd_rank = (
            (svd_up.shape[0] if deq.use_quantized_matmul else svd_up.shape[1])
            if svd_up is not None
            else deq.svd_rank
        )
        scale = getattr(module, "scale", None)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # svd_lowrank and stochastic rounding draw: keep the caller's RNG untouched
            new_deq, tensors = sdnq_quantize_layer_weight(
                weight.detach().reshape(deq.original_shape).to(deq.result_dtype),
                layer_class_name=deq.layer_class_name,
                weights_dtype=deq.weights_dtype,
                scale_dtype=deq.scale_dtype,
                zero_point_dtype=deq.zero_point_dtype,
                quantized_matmul_dtype=deq.quantized_matmul_dtype,
                group_size=deq.group_size,
                hadamard_group_size=deq.hadamard_group_size,
                svd_rank=svd_rank,
                svd_steps=deq.svd_steps,
                codebook_steps=deq.codebook_steps,
                use_svd=svd_up is not None,
                use_hadamard=deq.use_hadamard,
                use_codebook=deq.use_codebook,
                use_codebook_scale=deq.use_codebook_scale,
                use_quantized_matmul=deq.use_quantized_matmul,
                use_stochastic_rounding=deq.use_stochastic_rounding,
                dequantize_fp32=scale is not None and scale.dtype == torch.float32,
                torch_dtype=deq.result_dtype,
            )
        restore = _stash(module, (*_KEYS, "sdnq_dequantizer"))
        weight_param = module.weight
        assert isinstance(weight_param, torch.Tensor)  # SDNQ layers hold their packed weight as a parameter
        device = weight_param.device
        for key in _KEYS:
            value = tensors.get(key)
            _set_tensor(module, key, None if value is None else value.to(device), as_param=True)
        module.__dict__["sdnq_dequantizer"] = new_deq
        return restore

    def append_factors(self, module: torch.nn.Module, down: torch.Tensor, up: torch.Tensor) -> Restore:
        from sdnq.quant_utils import get_hadamard, rotate_hadamard

        deq: Any = module.sdnq_dequantizer  # an SDNQDequantizer: sdnq ships no types
        old_up, old_down = getattr(module, "svd_up", None), getattr(module, "svd_down", None)
        dtype = old_up.dtype if old_up is not None else deq.result_dtype
        weight_param = module.weight
        assert isinstance(weight_param, torch.Tensor)  # SDNQ layers hold their packed weight as a parameter
        device = weight_param.device
        with torch.no_grad():
            down = down.detach().to(device, torch.float32)
            if (
                deq.use_hadamard
            ):  # the dequantized sum is rotated by H afterwards: store A·H so that (B·A·H)·H = B·A
                down = rotate_hadamard(
                    down, hadamard=get_hadamard(deq.hadamard_group_size, torch.float32, device)
                )
            down, up = down.to(dtype), up.detach().to(device, dtype)
            if deq.use_quantized_matmul:  # transposed layout: svd_up (r, out), svd_down (in, r)
                new_up = up.t() if old_up is None else torch.cat([old_up, up.t()], 0)
                new_down = down.t() if old_down is None else torch.cat([old_down, down.t()], 1)
            else:
                new_up = up if old_up is None else torch.cat([old_up, up], 1)
                new_down = down if old_down is None else torch.cat([old_down, down], 0)
        restore = _stash(module, ("svd_up", "svd_down"))
        as_param = "svd_up" in module._parameters
        _set_tensor(module, "svd_up", new_up.contiguous(), as_param)
        _set_tensor(module, "svd_down", new_down.contiguous(), as_param)
        return restore


BACKEND = SdnqBackend()
