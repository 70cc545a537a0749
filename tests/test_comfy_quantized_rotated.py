"""ConvRot W4A4 and AsymW4A8Int8 (the latest tree's Hadamard-rotated layouts): the runtime term of the pack
lands in the right basis.

These layouts store W·H (a regular Hadamard rotation of each group of input channels, sd.cpp's
docs/int8_convrot.md format) and rotate the activations online, so the layer computes x·Wᵀ in the ORIGINAL
basis; `dequantize()` undoes the rotation. The pack's runtime path adds its term beside the layer's output, in
that same basis, so a delta never has to be rotated. Checked on the tiny Flux file (helpers/comfy_quant.py,
groups of 64) through ComfyUI's own loader and CPU kernels, per layer:

- the layer's own output follows x·W_qᵀ (W_q = dequantize(), rotation undone) to its activation rounding
  (relative error below 0.25 for W4A4, 0.05 for W4A8: 0.12 and 0.007 measured), and misses x·(W_q·S)ᵀ, the
  weight read in a rotated basis (S a block Hadamard of the same group size), by more than its own norm;
- with a LoRA in `auto` mode (runtime) the output moves by exactly x·ΔWᵀ (fp32 bound of
  test_comfy_quantized_runtime.py), and not by x·(ΔW·S)ᵀ, the delta rotated as the storage is, which misses
  x·ΔWᵀ by more than its own norm.

v0.19.3 registers neither layout (asserted: the rotated cases run on the latest tree only)."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_env import COMFYUI_TREE, import_comfy
from helpers.comfy_files import adapter_file, kohya
from helpers.comfy_quant import CONVROT_GROUP, ROTATED, load_flux, quant_algos, quantized_linears, write_flux

from loraweave.comfy import load_lora_for_models
from loraweave.comfy.quantized import dequantized

pytestmark = [pytest.mark.comfy, pytest.mark.usefixtures("one_thread")]
HERE = [fmt for fmt in ROTATED if fmt in quant_algos()]
BASE_ERROR = {"convrot_w4a4": 0.25, "asym_w4a8_int8": 0.05}
BOUND = 2.0**-18


def test_rotated_layouts_are_registered_only_on_the_latest_tree():
    assert (HERE == list(ROTATED)) == (COMFYUI_TREE == "latest"), (COMFYUI_TREE, sorted(quant_algos()))
    assert HERE or sorted(quant_algos()) == ["float8_e4m3fn", "float8_e5m2", "mxfp8", "nvfp4"]


def block_hadamard(n: int) -> torch.Tensor:
    """An orthonormal block-diagonal Sylvester Hadamard (blocks of CONVROT_GROUP) on n input channels."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < CONVROT_GROUP:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / CONVROT_GROUP**0.5] * (n // CONVROT_GROUP))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("fmt", ROTATED)
def test_runtime_term_lands_in_the_layers_basis(tmp_path, fmt):
    if fmt not in HERE:  # a reason in the skip line, where an empty parameter set would say nothing
        pytest.skip(f"ComfyUI {COMFYUI_TREE} does not register {fmt} (asserted by the registration test)")
    c = import_comfy()
    patcher = load_flux(write_flux(tmp_path, fmt), fmt)
    layers = quantized_linears(patcher)
    sd = adapter_file(layers, "lora", kohya("lora_unet_"))
    g = torch.Generator().manual_seed(11)
    xs = {name: torch.randn(16, m.in_features, generator=g) for name, m in layers.items()}
    with torch.no_grad():
        base = {name: layers[name](x) for name, x in xs.items()}
    model, _, report = load_lora_for_models(patcher, None, sd, 1.0, 0.0)
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == len(sd)
    c.model_management.load_models_gpu([model])
    try:
        with torch.no_grad():
            ours = {name: layers[name](x) for name, x in xs.items()}
    finally:
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    for name, m in layers.items():
        x, w_q = xs[name].double(), dequantized(m.weight).double()
        s = block_hadamard(m.in_features)
        y0 = base[name].double() - m.bias.double()
        assert rel(y0, x @ w_q.T) < BASE_ERROR[fmt], (name, rel(y0, x @ w_q.T))
        assert rel(y0, x @ (w_q @ s).T) > 1.0, (name, rel(y0, x @ (w_q @ s).T))
        stem = "lora_unet_" + name.replace(".", "_")
        down = sd[f"{stem}.lora_down.weight"].double()
        delta = sd[f"{stem}.alpha"].item() / down.shape[0] * sd[f"{stem}.lora_up.weight"].double() @ down
        moved, term = ours[name].double() - base[name].double(), x @ delta.T
        assert ((moved - term).abs() <= BOUND * (base[name].double().abs() + term.abs().max())).all(), name
        assert rel(x @ (delta @ s).T, term) > 1.0, name
