"""What the pack knows of ComfyUI's quantized weights: comfy_kitchen `QuantizedTensor`s (the layouts a
`comfy_quant` checkpoint or an "fp8_scaled" file loads into) and plain float8 weights.

- Every quantized weight of the diffusion model must name a layout comfy_kitchen registers; one that does
  not can neither run nor be dequantized, and is refused before anything is cloned (`check_layouts`).
- A merge on such a weight is ComfyUI's own: `patch_weight_to_device` dequantizes, adds the patch list's ΔW
  in float, and requantizes (scale recalculated, stochastic rounding seeded by the key). `merge_retention`
  performs that very call on the merged clone (`return_weight=True`: the model is not written) and measures
  what survived: ρ = <ΔW_applied, ΔW>/‖ΔW‖², ΔW_applied = dequantize(requantized) − dequantize(base), ΔW the
  float patch result (ComfyUI's `calculate_weight` in fp32) less the dequantized base. It is ComfyUI's storage
  fact: the runtime path never rounds ΔW, so its layers carry no ρ."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import QuantizedLayoutError
from ..mechanisms.quantized.write import retention
from ..quant.comfy_kitchen import is_quantized_tensor, layout_class, layout_name
from ..report.report import AppliedModule
from .host import comfy_module

log = logging.getLogger("loraweave")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LAYOUT_FIELD = "comfy_quant format (the QuantizedTensor's layout)"


def is_quantized(weight: object) -> bool:
    """A comfy_kitchen QuantizedTensor, or a plain tensor ComfyUI stores in a non-float dtype (float8)."""
    if is_quantized_tensor(weight):
        return True
    return isinstance(weight, torch.Tensor) and weight.dtype not in FLOAT_DTYPES


def dequantized(weight: Any) -> torch.Tensor:
    """The float32 weight a quantized `weight` stands for, through its own API (ConvRot: rotated back)."""
    if is_quantized_tensor(weight):
        return weight.dequantize().to(torch.float32)
    return weight.to(torch.float32)


def check_layouts(patcher) -> None:
    """QuantizedLayoutError naming the first diffusion-model layer whose QuantizedTensor names a layout
    comfy_kitchen does not register (it can neither run nor be read); nothing is changed."""
    for name, module in patcher.model.diffusion_model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if is_quantized_tensor(param) and layout_class(param) is None:
                raise QuantizedLayoutError(
                    f"layer diffusion_model.{name}.{pname}: {LAYOUT_FIELD} {layout_name(param)!r} is not a "
                    "layout comfy_kitchen registers here; loraweave cannot read that weight (nothing applied)"
                )


@torch.no_grad()  # as ComfyUI patches (its prompts run under inference mode); its parameters require grad
def merge_retention(patcher, key: str) -> float | None:
    """ρ of ComfyUI's merge of the patch list on weight `key` (module docstring); None for a float weight."""
    model_patcher = comfy_module("comfy.model_patcher")
    weight, _, _ = model_patcher.get_key_weight(patcher.model, key)
    if key not in patcher.patches or not is_quantized(weight):
        return None
    device = getattr(patcher, "load_device", None) or weight.device
    base = dequantized(weight).to(device)
    intended = comfy_module("comfy.lora").calculate_weight(patcher.patches[key], base.clone(), key) - base
    after = patcher.patch_weight_to_device(key, device_to=device, return_weight=True)
    return retention(dequantized(after).to(device) - base, intended)


def requantized_why(weight: Any) -> str:
    if is_quantized_tensor(weight):
        how = f"requantizes W + ΔW into {layout_name(weight)} (scale recalculated, stochastic rounding)"
    else:
        how = f"rounds W + ΔW to {str(weight.dtype).removeprefix('torch.')} (stochastic rounding)"
    return f"ComfyUI {how} on its patch path; retention measured on that path"


def with_retention(patcher, rows: list[AppliedModule]) -> None:
    """Set ρ (and the storage it was measured on) on `patcher`'s merged rows whose weight is quantized."""
    model_patcher = comfy_module("comfy.model_patcher")
    for row in rows:
        key = f"{row.component}.{row.module}.weight"
        if row.mechanism != "merge" or key not in patcher.patches:
            continue
        weight, _, _ = model_patcher.get_key_weight(patcher.model, key)
        if not is_quantized(weight):
            continue
        row.backend = "comfy_kitchen" if is_quantized_tensor(weight) else ""
        row.why = requantized_why(weight)
        try:
            row.retention = merge_retention(patcher, key)
        except Exception as exc:  # noqa: BLE001 - a patcher kind this was not run on: said, never fatal
            row.notes.append(f"retention not measured: {type(exc).__name__}: {exc}")
            log.warning("comfy merge_retention key=%s failed=%r", key, exc)
            continue
        log.debug("comfy merge_retention key=%s rho=%.6f", key, row.retention)
