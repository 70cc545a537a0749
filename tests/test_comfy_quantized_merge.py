"""loraweave.comfy `merge` on ComfyUI's quantized checkpoints (helpers/comfy_quant.py: every format the
imported tree registers, the legacy fp8_scaled file and plain float8 weights, loaded by ComfyUI's own
loader), for LoRA, LoKr,
LoHa, DoRA and OFT files on every quantized block Linear plus one float layer (`final_layer.linear`, which the
mixed-precision file keeps fp32; none with weight_dtype): LoRA on every format, every family on NVFP4.

The merge goes through ComfyUI's own requantization (its patch path: dequantize, add, requantize_from_float
with the scale recalculated and stochastic rounding seeded by the key), and the report gives, per quantized
layer, the ΔW retention ρ = <ΔW_applied, ΔW>/‖ΔW‖² with the storage it was measured on; the float layer has
none. Checked against an independent measurement after ComfyUI loaded the clone: each patched weight
dequantized, less the dequantized base, against ΔW = W' − W_q in fp64 (helpers/comfy_quant.py merged_fp64):
the reported ρ equals it to 1e-5 absolute (the report's ΔW is ComfyUI's fp32 patch result, the test's
fp64; the requantized weights are the same, bit for bit, as the loaded ones). Every stored tensor is equal
byte for byte after the clone is unloaded."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_files import FAMILIES, adapter_file, kohya
from helpers.comfy_quant import (
    WEIGHT_DTYPES,
    formats,
    layout_of,
    load_flux,
    merged_fp64,
    quantized_linears,
    same_bytes,
    storage,
    write_flux,
)

from loraweave.comfy import load_lora_for_models
from loraweave.comfy.quantized import dequantized

pytestmark = [pytest.mark.comfy, pytest.mark.usefixtures("one_thread")]
STRENGTH = 0.7
FLOAT_LAYER = "final_layer.linear"
# ρ is ComfyUI's storage fact, the same path for every family: LoRA on every format, every family on NVFP4.
CASES = [
    pytest.param(fmt, family, id=f"{fmt}-{family}")
    for fmt, family in dict.fromkeys([*((f, "lora") for f in formats()), *(("nvfp4", f) for f in FAMILIES)])
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder, built = tmp_path_factory.mktemp("quantized-flux"), {}

    def get(fmt: str):
        if fmt not in built:
            built[fmt] = load_flux(write_flux(folder, fmt), fmt)
        return built[fmt]

    return get


@pytest.mark.parametrize(("fmt", "family"), CASES)
def test_merge_requantizes_through_comfyui_and_reports_retention(models, fmt, family):
    c = import_comfy()
    patcher = models(fmt)
    layers = quantized_linears(patcher)
    # a float layer beside them (weight_dtype casts every weight: there is none)
    floats = (
        {}
        if fmt in WEIGHT_DTYPES
        else {FLOAT_LAYER: patcher.model.diffusion_model.get_submodule(FLOAT_LAYER)}
    )
    assert all(
        m.weight.dtype == torch.float32 and type(m.weight) is torch.nn.Parameter for m in floats.values()
    )
    sd = adapter_file({**layers, **floats}, family, kohya("lora_unet_"))
    before = storage(patcher)

    model, _, report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.summary()
    rows = {r["module"]: r for r in report.to_dict()["applied"]}
    assert sorted(rows) == sorted([*layers, *floats])
    assert all(rows[name]["retention"] is None and rows[name]["backend"] == "" for name in floats)
    for name in layers:
        backend = "" if fmt in WEIGHT_DTYPES else "comfy_kitchen"
        assert rows[name]["mechanism"] == "merge" and rows[name]["backend"] == backend
        assert layout_of(fmt) in rows[name]["why"], rows[name]["why"]
    assert report.to_dict()["mechanisms"]["merge"]["retention_min"] == min(
        rows[n]["retention"] for n in layers
    )

    reference = merged_fp64(patcher, sd, STRENGTH)
    with torch.no_grad():  # as ComfyUI loads (its prompts run under inference mode)
        c.model_management.load_models_gpu([model])
    try:
        loaded = {name: dequantized(m.weight).double() for name, m in layers.items()}
        types = {type(m.weight).__name__ for m in layers.values()}
    finally:
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    # ComfyUI requantized, the layers stay quantized
    assert types == {"Parameter" if fmt in WEIGHT_DTYPES else "QuantizedTensor"}, types
    assert same_bytes(before, storage(patcher)), "a quantized tensor differs after the clone was unloaded"
    for name, ref in reference.items():
        if name == FLOAT_LAYER:
            continue
        intended, applied = ref.merged - ref.w_q, loaded[name] - ref.w_q
        measured = float((applied * intended).sum() / intended.square().sum())
        assert abs(rows[name]["retention"] - measured) <= 1e-5, (name, rows[name]["retention"], measured)
        assert not torch.equal(loaded[name], ref.w_q), f"{name}: the merge changed nothing"


def test_retention_that_cannot_be_measured_is_said_not_fatal(models, monkeypatch):
    # A patcher whose patch path fails here (a kind the measurement never ran on): the merge still lands, the
    # row says why ρ is missing.
    patcher = models("float8_e4m3fn")
    layers = quantized_linears(patcher)
    sd = adapter_file(layers, "lora", kohya("lora_unet_"))
    c = import_comfy()

    def broken(self, *args, **kwargs):
        raise RuntimeError("no patch path here")

    monkeypatch.setattr(c.model_patcher.ModelPatcher, "patch_weight_to_device", broken)
    _, _, report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd)
    for row in report.applied:
        assert row.retention is None and row.backend == "comfy_kitchen"
        assert row.notes == ["retention not measured: RuntimeError: no patch path here"], row.notes
