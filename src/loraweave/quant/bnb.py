"""bitsandbytes layers: `Linear8bitLt` (rowwise int8) and `Linear4bit` (NF4 / FP4 codebooks, blockwise
absmax).

On CPUs with AVX512-BF16, `Linear4bit` repacks its weight on the first eval forward into a kernel layout with
bf16 absmax (`quant_state.packing_format_for_cpu`); dequantize reads either layout without touching the
layer."""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from ..errors import ArgumentError
from .backend import Capabilities, KindProbedBackend, Restore, probe_once

log = logging.getLogger("loraweave")


def _run_probe() -> dict[str, str | None]:
    """{kind: why it cannot run here or None}, from tiny layers quantized and run on CPU."""
    try:
        import bitsandbytes as bnb
    except Exception as exc:  # an install without its native library raises more than ImportError
        return {"package": f"bitsandbytes not importable: {type(exc).__name__}: {exc}"}
    out: dict[str, str | None] = {"package": None}
    x = torch.ones(1, 64)
    for kind in ("int8", "nf4", "fp4"):
        try:
            layer: torch.nn.Module
            if kind == "int8":
                layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False, threshold=0.0)
            else:
                layer = bnb.nn.Linear4bit(64, 32, bias=False, quant_type=kind, compute_dtype=torch.float32)
            layer.load_state_dict({"weight": torch.full((32, 64), 0.5)})
            layer = layer.to("cpu")
            out[kind] = None
            for training in (
                True,
                False,
            ):  # train: dequantize + matmul; eval: int8 matmul / packed 4-bit kernel
                with torch.no_grad():
                    y = layer.train(training)(x)
                if not torch.allclose(y, torch.full_like(y, 32.0), rtol=0.05):
                    out[kind] = f"{kind} forward on CPU is wrong (got {float(y.mean()):.3g}, expected 32)"
        except Exception as exc:
            out[kind] = f"{kind} does not run on CPU: {type(exc).__name__}: {exc}"
    return out


def _kind(module: torch.nn.Module) -> str:
    weight: Any = module.weight  # Int8Params or Params4bit: their quant state is set at runtime
    if hasattr(weight, "quant_state") or type(weight).__name__ == "Params4bit":
        return getattr(weight, "quant_type", None) or weight.quant_state.quant_type
    return "int8"


def _int8_state(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(CB int8 (out, in), SCB row absmax): the first forward moves them from the weight into
    `module.state`."""
    layer: Any = module  # a Linear8bitLt: CB/SCB live on its weight or its MatmulLtState
    weight = layer.weight
    cb = weight.CB if getattr(weight, "CB", None) is not None else layer.state.CB
    scb = weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB
    if cb is None:
        cb = weight.data
    if scb is None:
        raise ArgumentError(
            "target: a bitsandbytes int8 layer has no SCB: it was never quantized (call .to(device) first)"
        )
    return cb, scb


def _absmax(qs) -> torch.Tensor:
    """Per-block absmax as float32, whatever the layout (nested statistics, CPU kernel packing)."""
    import bitsandbytes.functional as bf

    if getattr(qs, "packing_format_for_cpu", False):
        return qs.absmax.float().t()  # stored (blocks per row, rows) in bf16 -> (rows, blocks per row)
    if qs.nested:
        return bf.dequantize_blockwise(qs.absmax, qs.state2).float() + qs.offset
    return qs.absmax.float()


def _unpack_cpu_layout(packed: torch.Tensor, rows: int, cols: int, block_n: int = 32) -> torch.Tensor:
    """4-bit codes (rows, cols) from the AVX512 kernel layout, without touching the layer (bnb's own inverse
    rewrites the QuantState in place)."""
    p = packed.reshape(-1, 32)
    codes = torch.cat([p & 0xF, (p >> 4) & 0xF], dim=-1)  # per 64: 32 low nibbles, then 32 high
    codes = codes.reshape(rows // block_n, cols // 2, block_n, 2).transpose(1, 2)
    return codes.reshape(rows, cols).long()


def _dequantize_4bit(module: torch.nn.Module) -> torch.Tensor:
    import bitsandbytes.functional as bf

    weight: Any = module.weight  # Int8Params or Params4bit: their quant state is set at runtime
    qs = weight.quant_state
    rows, cols = qs.shape
    if not getattr(qs, "packing_format_for_cpu", False):
        return bf.dequantize_4bit(weight.data, qs).float().reshape(rows, cols)
    codes = _unpack_cpu_layout(weight.data.view(torch.uint8), rows, cols)
    levels = qs.code.float()[codes]  # (rows, cols)
    absmax = _absmax(qs)  # (rows, cols // blocksize); packing requires blocks that do not cross rows
    w = levels.reshape(rows, cols // qs.blocksize, qs.blocksize) * absmax.unsqueeze(-1)
    # The kernel computes in bf16 from bf16 absmax: the weight it uses is this product rounded to bf16.
    return w.reshape(rows, cols).to(qs.dtype).float()


_probe = probe_once(_run_probe)


class BitsAndBytesBackend(KindProbedBackend):
    probe = staticmethod(_probe)
    name = "bitsandbytes"

    def owns(self, module: torch.nn.Module) -> bool:
        return type(module).__name__ in ("Linear8bitLt", "Linear4bit", "LinearNF4", "LinearFP4") and type(
            getattr(module, "weight", None)
        ).__name__ in ("Int8Params", "Params4bit")

    def capabilities(self, module: torch.nn.Module) -> Capabilities:
        why = self.kind_unavailable(_kind(module))
        if why:
            return Capabilities(dequantize=False, requantize=False, factor_channel=False, reason=why)
        if getattr(module.weight, "has_fp16_weights", False):
            return Capabilities(
                False, False, False, "int8 layer keeps fp16 weights (training mode): not quantized"
            )
        return Capabilities(
            dequantize=True, requantize=True, factor_channel=False, reason="no low-rank side branch"
        )

    def bits(self, module: torch.nn.Module) -> int:
        return 8 if _kind(module) == "int8" else 4

    def grid_step(self, module: torch.nn.Module) -> float:
        if _kind(module) == "int8":
            _, scb = _int8_state(module)
            return float((scb.float() / 127.0).mean())
        weight: Any = module.weight  # Int8Params or Params4bit: their quant state is set at runtime
        qs = weight.quant_state
        levels = torch.unique(qs.code.float())  # sorted; FP4's +0 and -0 collapse into one level
        gap = float((levels[1:] - levels[:-1]).mean())
        return gap * float(_absmax(qs).abs().mean())

    def dequantize(self, module: torch.nn.Module) -> torch.Tensor:
        if _kind(module) != "int8":
            return _dequantize_4bit(module)
        cb, scb = _int8_state(module)
        return cb.float() * (scb.float().unsqueeze(1) / 127.0)

    def requantize(self, module: torch.nn.Module, weight: torch.Tensor) -> Restore:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf

        old_param: Any = module._parameters["weight"]  # Int8Params or Params4bit
        had_qs, old_qs = "quant_state" in module.__dict__, module.__dict__.get("quant_state")
        state = getattr(module, "state", None)
        old_cb, old_scb = (state.CB, state.SCB) if state is not None else (None, None)
        new: torch.nn.Parameter
        if _kind(module) == "int8":
            # The layer's own path: fp16 rows, vectorwise absmax.
            cb, scb, _ = bf.int8_vectorwise_quant(weight.detach().contiguous().to(torch.float16))
            new = bnb.nn.Int8Params(cb, requires_grad=False, has_fp16_weights=False, CB=cb, SCB=scb)
            assert state is not None  # a Linear8bitLt always has its MatmulLtState
            state.CB, state.SCB = None, None  # the next forward moves the new CB/SCB in
        else:
            qs = old_param.quant_state
            packed = getattr(qs, "packing_format_for_cpu", False)
            dtype = qs.original_dtype if packed else qs.dtype
            nested = qs.original_nested if packed else qs.nested
            data, new_qs = bf.quantize_4bit(
                weight.detach().contiguous().to(dtype),
                blocksize=qs.blocksize,
                compress_statistics=nested,
                quant_type=qs.quant_type,
                quant_storage=old_param.quant_storage,
            )
            new = bnb.nn.Params4bit(
                data,
                requires_grad=False,
                quant_state=new_qs,
                blocksize=qs.blocksize,
                compress_statistics=nested,
                quant_type=qs.quant_type,
                quant_storage=old_param.quant_storage,
                module=cast(bnb.nn.Linear4bit, module),
                bnb_quantized=True,
            )
            module.__dict__["quant_state"] = new_qs
        module._parameters["weight"] = new
        log.debug("requantize backend=bitsandbytes kind=%s shape=%s", _kind(module), tuple(weight.shape))

        def restore() -> None:
            module._parameters["weight"] = old_param
            if had_qs:
                module.__dict__["quant_state"] = old_qs
            else:
                module.__dict__.pop("quant_state", None)
            if state is not None:
                state.CB, state.SCB = old_cb, old_scb

        return restore


BACKEND = BitsAndBytesBackend()
