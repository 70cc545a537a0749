"""loraweave.comfy in `auto` mode on ComfyUI's quantized checkpoints: every format the imported tree registers
(v0.19.3: float8_e4m3fn, float8_e5m2, nvfp4, mxfp8; the latest tree also int8_tensorwise, convrot_w4a4,
asym_w4a8_int8), the legacy "fp8_scaled" file and plain float8 weights (UNETLoader's weight_dtype
fp8_e4m3fn / fp8_e5m2: no scale, manual_cast), each a tiny Flux file written by this test and loaded by
ComfyUI's own `load_diffusion_model` (helpers/comfy_quant.py), with comfy_kitchen's CPU (eager) backends.

For LoRA, LoKr, LoHa, DoRA and OFT files on every quantized block Linear: `auto` chooses runtime on every
layer, and each layer's output with the adapter equals the quantized base's own output y (the same layer,
unpatched: ComfyUI's own forward, whatever its kernel) plus the exact adapter term in fp64: x·(W' − W_q)ᵀ,
W_q the layer's own dequantized weight and W' = W_q with the file merged by loraweave's families in fp64; for
OFT and DoRA, whose term acts on the layer's output (a rotation, a row gain G), G·(y − b − x·W_qᵀ) on top,
i.e. the term on the base's own output (helpers/comfy_quant.py Reference). Bound, per element: 2⁻¹⁸ (64 fp32
ulps) of |y| + max|term| of the layer (the term is formed in fp32); the term exceeds the bound more than
1000-fold, so a missing or wrong term fails. Every stored tensor (data and scales) is equal, byte for byte,
before, while the clone is loaded and after it is unloaded, and the unpatched layer's output after is
bit-identical to before.

On CPU ComfyUI runs fp8, NVFP4 and MXFP8 layers as dequantize + float GEMM (their native compute is
disabled there), so y = x·W_qᵀ + b to fp32 rounding; int8_tensorwise, convrot_w4a4 and asym_w4a8_int8 run
comfy_kitchen's eager quantized kernels (activations quantized too, even with full_precision_matrix_mult),
so y differs from x·W_qᵀ by that kernel's activation rounding, which the term on the output carries."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_files import FAMILIES, adapter_file, kohya
from helpers.comfy_quant import (
    WEIGHT_DTYPES,
    formats,
    load_flux,
    merged_fp64,
    quantized_linears,
    same_bytes,
    storage,
    write_flux,
)

from loraweave.comfy import load_lora_for_models

pytestmark = [pytest.mark.comfy, pytest.mark.usefixtures("one_thread")]
STRENGTH = 0.7
BOUND = 2.0**-18
CASES = [pytest.param(fmt, family, id=f"{fmt}-{family}") for fmt in formats() for family in FAMILIES]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder, built = tmp_path_factory.mktemp("quantized-flux"), {}

    def get(fmt: str):
        if fmt not in built:
            built[fmt] = load_flux(write_flux(folder, fmt), fmt)
        return built[fmt]

    return get


def outputs(layers: dict, xs: dict) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: layers[name](x) for name, x in xs.items()}


@pytest.mark.parametrize(("fmt", "family"), CASES)
def test_auto_runtime_exact_storage_untouched(models, fmt, family):
    c = import_comfy()
    patcher = models(fmt)
    layers = quantized_linears(patcher)
    sd = adapter_file(layers, family, kohya("lora_unet_"))
    g = torch.Generator().manual_seed(5)
    xs = {name: torch.randn(2, 7, m.in_features, generator=g) for name, m in layers.items()}
    before, base = storage(patcher), outputs(layers, xs)
    if fmt not in WEIGHT_DTYPES:  # a QuantizedTensor: its scales are compared too
        assert {k.rsplit(".", 1)[0] for k in before if "_param_" in k} >= set(layers), "scales not compared"

    model, _, report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0)  # mode="auto"
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == len(sd), report.summary()
    assert sorted(r.module for r in report.applied) == sorted(layers)
    assert {r.mechanism for r in report.applied} == {"runtime"}
    c.model_management.load_models_gpu([model])
    try:
        ours, during = outputs(layers, xs), storage(patcher)
    finally:
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    assert same_bytes(before, during), "a quantized tensor changed while the adapter was applied"
    assert same_bytes(before, storage(patcher)), "a quantized tensor changed after removal"
    after = outputs(layers, xs)
    assert all(torch.equal(after[n], base[n]) for n in layers), "the base output changed after removal"

    reference = merged_fp64(patcher, sd, STRENGTH)
    assert sorted(reference) == sorted(layers)
    for name, ref in reference.items():
        term = ref.term(xs[name], base[name] - layers[name].bias.to(base[name].dtype))
        err = (ours[name].double() - base[name].double() - term).abs()
        bound = BOUND * (base[name].double().abs() + term.abs().max())
        assert (err <= bound).all(), f"{name}: {(err / bound).max().item():.3g} x the bound"
        assert term.abs().max() > 1000 * bound.max(), f"{name}: the term is too small to prove anything"
