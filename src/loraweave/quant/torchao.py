"""torchao layers: a plain `nn.Linear` whose weight is a torchao tensor subclass (`quantize_(model, config)`).

Weight-only int8 is `Int8Tensor`; int4 is `Int4Tensor` (`Int4WeightOnlyConfig`, CUDA kernels only) or, on CPU,
`IntxUnpackedToInt8Tensor` (`IntxWeightOnlyConfig(weight_dtype=torch.int4)`). Requantize rebuilds the same
subclass from the layer's own block size, dtype and mapping; other subclasses are dequantized only."""

from __future__ import annotations

import logging

import torch

from .backend import Capabilities, KindProbedBackend, Restore, probe_once

log = logging.getLogger("loraweave")

_REQUANT = (
    "Int8Tensor",
    "IntxUnpackedToInt8Tensor",
    "Float8Tensor",
)  # the subclasses rebuilt from a float weight
_BITS = {
    "Int4Tensor": 4,
    "Int4PreshuffledTensor": 4,
    "Int4PlainInt32Tensor": 4,
    "Int4TilePackedTo4dTensor": 4,
    "IntxOpaqueTensor": 4,
    "NF4Tensor": 4,
    "Float8Tensor": 8,
    "Int8Tensor": 8,
}


def _configs() -> dict[str, object]:
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    int4 = torch.int4  # type: ignore[attr-defined]  # a torch dtype at runtime; torch's stubs omit it
    return {
        "int8": Int8WeightOnlyConfig(),
        "int4": Int4WeightOnlyConfig(group_size=32),
        "intx-int4": IntxWeightOnlyConfig(weight_dtype=int4, granularity=PerGroup(32)),
        "float8": Float8WeightOnlyConfig(),
    }


def _run_probe() -> dict[str, str | None]:
    """{kind: why it cannot run here or None}: each config quantizes a tiny Linear and runs it on CPU."""
    try:
        from torchao.quantization import quantize_
    except Exception as exc:
        return {"package": f"torchao not importable: {type(exc).__name__}: {exc}"}
    out: dict[str, str | None] = {"package": None}
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    for kind, config in _configs().items():
        try:
            linear = torch.nn.Linear(64, 32, bias=False)
            layer = torch.nn.Sequential(linear)
            ref = linear.weight.detach().clone()
            quantize_(layer, config)
            with torch.no_grad():
                y = layer(x)
            # a working kernel lands within a few grid steps of the float result
            err = float((y - x @ ref.t()).abs().max() / (x @ ref.t()).abs().max())
            out[kind] = None if err < 0.2 else f"{kind} forward on CPU is wrong (rel. err {err:.3g})"
        except Exception as exc:  # e.g. Int4WeightOnlyConfig: "Requires mslk", no CPU packing format
            out[kind] = f"{kind} does not run on CPU: {type(exc).__name__}: {exc}"
    return out


def _granularity(old):
    """The granularity that gives back `old.block_size`: per row, per tensor, else per block."""
    from torchao.quantization.granularity import PerBlock, PerRow, PerTensor

    block, shape = list(old.block_size), list(old.shape)
    if block == shape:
        return PerTensor()
    if block[:-1] == [1] * (len(block) - 1) and block[-1] == shape[-1]:
        return PerRow()
    return PerBlock(tuple(block))


def _float8_step(weight) -> float:
    """Mean spacing of the float8 grid at each stored value (its ulp), times the block scale."""
    q = weight.qdata.float()
    info = torch.finfo(weight.qdata.dtype)
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}.get(weight.qdata.dtype, 3)
    exponent = torch.floor(torch.log2(q.abs().clamp_min(info.smallest_normal)))  # subnormals: the min spacing
    ulp = torch.exp2(exponent - mantissa)
    scale = weight.scale.float()
    for dim, b in enumerate(weight.block_size):  # broadcast the per-block scale over its block
        scale = scale.repeat_interleave(b, dim=dim) if scale.shape[dim] != q.shape[dim] else scale
    return float((ulp * scale).mean())


def _weight(module: torch.nn.Module):
    return getattr(module, "weight", None)


_probe = probe_once(_run_probe)


class TorchAOBackend(KindProbedBackend):
    probe = staticmethod(_probe)
    name = "torchao"

    def owns(self, module: torch.nn.Module) -> bool:
        weight = _weight(module)
        if weight is None or type(weight) in (torch.Tensor, torch.nn.Parameter):
            return False
        return any(c.__name__ == "TorchAOBaseTensor" for c in type(weight).__mro__)

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        why = _probe()["package"]
        if why:
            return Capabilities(False, False, False, why)
        weight = _weight(module)
        name = type(weight).__name__
        if not callable(getattr(weight, "dequantize", None)):
            return Capabilities(False, False, False, f"torchao {name} has no dequantize()")
        if name not in _REQUANT:
            return Capabilities(True, False, False, f"requantize not supported for torchao {name}")
        act = getattr(weight, "activation_quantization", None) or getattr(weight, "act_quant_kwargs", None)
        note = "; forward also quantizes activations" if act is not None else ""
        return Capabilities(True, True, False, "no low-rank side branch" + note)

    def bits(self, module: torch.nn.Module) -> int:
        weight = _weight(module)
        name = type(weight).__name__
        if name == "IntxUnpackedToInt8Tensor":
            return int(str(weight.target_dtype).removeprefix("torch.int"))
        if name in _BITS:
            return _BITS[name]
        raise ValueError(f"bits unknown for torchao {name}")

    def grid_step(self, module: torch.nn.Module) -> float:
        weight = _weight(module)
        if type(weight).__name__ not in _REQUANT:
            raise ValueError(f"grid step unknown for torchao {type(weight).__name__}")
        if type(weight).__name__ == "Float8Tensor":
            return _float8_step(weight)
        return float(weight.scale.float().abs().mean())  # affine grids: the step is the scale

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        return _weight(module).dequantize().detach().float()

    def _rebuild(self, old, weight: torch.Tensor):
        from torchao.quantization import Float8Tensor, Int8Tensor, IntxUnpackedToInt8Tensor
        from torchao.quantization.granularity import PerBlock
        from torchao.quantization.quant_primitives import MappingType

        hp = weight.detach().to(old.dtype).contiguous()
        zp = getattr(old, "zero_point", None)
        asym = zp is not None and bool((zp != 0).any())
        mapping = MappingType.ASYMMETRIC if asym else MappingType.SYMMETRIC
        if type(old).__name__ == "Float8Tensor":
            return Float8Tensor.from_hp(
                hp,
                float8_dtype=old.qdata.dtype,
                granularity=_granularity(old),
                mm_config=old.mm_config,
                kernel_preference=old.kernel_preference,
                act_quant_kwargs=old.act_quant_kwargs,
            )
        if type(old).__name__ == "Int8Tensor":
            return Int8Tensor.from_hp(
                hp,
                PerBlock(tuple(old.block_size)),
                mapping_type=mapping,
                act_quant_kwargs=old.act_quant_kwargs,
                reduce_range=bool(getattr(old, "reduce_range", False)),
            )
        return IntxUnpackedToInt8Tensor.from_hp(
            hp,
            tuple(old.block_size),
            old.target_dtype,
            mapping_type=mapping,
            activation_quantization=old.activation_quantization,
        )

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        old_param = module._parameters["weight"]
        if old_param is None or type(old_param).__name__ not in _REQUANT:
            raise NotImplementedError(f"requantize not supported for torchao {type(old_param).__name__}")
        module._parameters["weight"] = torch.nn.Parameter(
            self._rebuild(old_param, weight), requires_grad=old_param.requires_grad
        )
        log.debug(
            "requantize backend=torchao kind=%s shape=%s", type(old_param).__name__, tuple(weight.shape)
        )

        def restore() -> None:
            module._parameters["weight"] = old_param

        return restore


BACKEND = TorchAOBackend()
