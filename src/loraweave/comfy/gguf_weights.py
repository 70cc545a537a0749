"""ComfyUI-GGUF's `GGMLTensor` weights in the pack (the backend fact is quant/comfy_gguf.py).

- `auto` runs them at runtime (api.quantized_base: a GGMLTensor is a tensor subclass): the paths sit beside
  the GGMLOps layer, whose blocks are never touched and whose patch list stays empty, so ComfyUI-GGUF does
  not re-patch any weight at any step; DoRA reads the layer's own dequantized weight once per strength.
- `merge` goes through ComfyUI's patch list, as core's LoraLoader does on these models: GGMLOps dequantizes
  the blocks and applies the patches (our exact ΔW) at every forward; ComfyUI-GGUF cannot requantize, so the
  blocks stay as loaded. Each such layer's report row names the backend and the ΔW retention ρ of that
  patching in the model's compute dtype (1 in fp32; bf16 rounds W + ΔW).
- A GGML tensor whose bytes do not hold its declared type and shape is refused with a typed error naming
  the layer, before anything is cloned (ComfyUI-GGUF's loader takes it; its forward would fail in torch)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import QuantizedWeightError
from ..quant import backend_for
from ..quant.comfy_gguf import BACKEND
from ..report.report import AppliedModule
from ..resolve.planner import Plan

GGUF_BACKEND = BACKEND.name
RUNTIME_WHY = "GGML blocks untouched: runtime path beside the GGMLOps layer, no per-step patch"
MERGE_F16_WHY = (
    "ComfyUI-GGUF merges into an F16/F32 GGUF row as core does (a patched copy of the weight's dtype while "
    "loaded, the loaded tensor back after); ρ of rounding W + ΔW to that dtype (to nearest)"
)
MERGE_WHY = (
    "ComfyUI-GGUF applies the patch list to the dequantized weight at every forward (GGMLOps.get_weight); "
    "it cannot requantize, so the GGML blocks stay as loaded"
)


def is_ggml(module: torch.nn.Module) -> bool:
    return backend_for(module) is BACKEND


def planned_layers(plan: Plan) -> Iterable[tuple[str, torch.nn.Module]]:
    """(component.path, module) of every layer the plan's parts land on, each once."""
    seen: set[str] = set()
    for pp in plan.planned:
        root = plan.components.modules[pp.component]
        for piece in pp.pieces:
            where = f"{pp.component}.{piece.module}"
            if where not in seen:
                seen.add(where)
                yield where, root.get_submodule(piece.module)


def check_storage(plan: Plan) -> None:
    """QuantizedWeightError naming the first planned GGML layer whose blocks do not hold its shape."""
    for where, module in planned_layers(plan):
        if is_ggml(module):
            problem = BACKEND.malformed(module)
            if problem is not None:
                raise QuantizedWeightError(f"{where}.weight: malformed GGUF tensor: {problem}")


def compute_dtype(patcher) -> torch.dtype:
    """The dtype ComfyUI runs the diffusion model in (its manual cast, else the model's dtype)."""
    model = patcher.model
    return getattr(model, "manual_cast_dtype", None) or model.get_dtype()


def patched_retention(module: torch.nn.Module, patches: list, key: str, dtype: torch.dtype) -> float:
    """ρ of ComfyUI-GGUF's patching of `module`: ⟨W_patched − W, ΔW⟩/‖ΔW‖², W dequantized in `dtype` as
    GGMLOps does at forward, ΔW the patches applied to that W in fp32."""
    from comfy.lora import calculate_weight

    weight = BACKEND.dequantize(module).to(dtype)
    intended = calculate_weight(patches, weight.to(torch.float32, copy=True), key) - weight.float()
    applied = calculate_weight(patches, weight.clone(), key).to(dtype).float() - weight.float()
    norm = float(intended.double().pow(2).sum())
    return float((applied.double() * intended.double()).sum()) / norm if norm > 0 else 1.0


def note_rows(rows: list[AppliedModule], plan: Plan, patcher=None) -> None:
    """Name the backend on the report rows of GGML layers; merge rows (`patcher`: the clone carrying the
    patches) also say how the patch list runs there and the ρ it keeps in the compute dtype."""
    layers = dict(planned_layers(plan))  # parameter patches' rows (scale_shift_table) name no layer: absent
    for row in rows:
        module = layers.get(f"{row.component}.{row.module}")
        if module is None or not is_ggml(module):
            continue
        row.backend = BACKEND.name
        if row.mechanism == "runtime":
            row.why = RUNTIME_WHY
        elif row.mechanism == "merge" and patcher is not None:
            key = f"{row.component}.{row.module}.weight"
            patches = patcher.patches.get(key)
            per_forward = BACKEND.bits(module) < 16  # quantized blocks: patched at forward, else merged
            row.why = MERGE_WHY if per_forward else MERGE_F16_WHY
            dtype = compute_dtype(patcher) if per_forward else BACKEND.weight_dtype(module)
            if patches:
                row.retention = patched_retention(module, patches, key, dtype)
