"""The real-size tier of the quantized checkpoints: one full-width Flux.1 layer (double_blocks.0.img_mlp.0,
12288 x 3072) stored as fp8 e4m3fn (per-tensor scale) and as NVFP4 (comfy_kitchen's eager CPU backend runs
both), in ComfyUI's own full-size Flux built on the meta device (helpers/realsize_comfy.py).

The layer is the one ComfyUI builds for a `comfy_quant` checkpoint on this machine: the Linear of
`comfy.ops.pick_operations` for a model config with a quant config (mixed-precision ops, bf16 compute, the
CPU's disabled native formats), filled by its own `_load_from_state_dict` from the tensors the layout's
`state_dict` names plus the `comfy_quant` entry. A kohya LoRA (rank 16, ‖ΔW‖ = 5% of ‖W‖) in `auto` mode
runs at runtime; with its injection on, the layer's bf16 output moves by s·x·Aᵀ·Bᵀ computed in fp64 to 2 bf16
ulp of |y| + |term| (the final add's rounding), 4 bf16 eps of the largest |term| (the term's own bf16 GEMMs)
and √fan_in·2⁻²⁴ of s·|x|·|A|ᵀ·|B|ᵀ (fp32 accumulation); the term exceeds that bound on most elements, so the
check can fail. Every stored tensor (data and scales) is equal, byte for byte, before, while injected and
after."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_quant import layout_of
from helpers.realsize import RealLayer, fill_seeded, lora_for, ulp
from helpers.realsize_comfy import meta_flux_patcher

from loraweave.comfy import load_lora_for_models
from loraweave.comfy.runtime import KEY
from loraweave.quant.comfy_kitchen import layout_name, stored_tensors

pytestmark = [pytest.mark.realsize, pytest.mark.comfy, pytest.mark.usefixtures("one_thread")]
MODULE = "double_blocks.0.img_mlp.0"
HIDDEN, MLP = 3072, 12288
RANK, ALPHA, STRENGTH = 16, 8.0, 0.8
SEED = 31


def comfy_quantized_layer(fmt: str) -> torch.nn.Module:
    """The Linear ComfyUI builds here for a `fmt` layer of a comfy_quant file, loaded as it loads one."""
    from comfy_kitchen.tensor import QuantizedTensor

    c = import_comfy()
    import comfy.ops

    ops = comfy.ops.pick_operations(
        None,
        torch.bfloat16,
        load_device=torch.device("cpu"),
        model_config=SimpleNamespace(quant_config={"x": 1}),
    )
    weight = torch.empty(MLP, HIDDEN)
    fill_seeded(weight, SEED)
    kwargs = {"scale": "recalculate"} if fmt.startswith("float8") else {}
    state = dict(QuantizedTensor.from_float(weight, layout_of(fmt), **kwargs).state_dict("weight"))
    state["bias"] = torch.randn(MLP, generator=torch.Generator().manual_seed(SEED)).bfloat16() * 0.01
    state["comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    layer = ops.Linear(HIDDEN, MLP, bias=True, device=torch.device("cpu"))
    layer.load_state_dict(state)
    assert c is not None and layout_name(layer.weight) == layout_of(fmt)
    return layer


def stored(layer) -> dict[str, torch.Tensor]:
    return {k: t.reshape(-1).view(torch.uint8).clone() for k, t in stored_tensors(layer.weight).items()}


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "nvfp4"])
def test_full_width_quantized_layer_runtime_exact_storage_untouched(fmt):
    flux = meta_flux_patcher(torch.bfloat16)
    flux.model.diffusion_model.set_submodule(MODULE, comfy_quantized_layer(fmt))
    layer = flux.model.diffusion_model.get_submodule(MODULE)
    lora = lora_for(RealLayer("flux", MODULE, (MLP, HIDDEN)), rank=RANK, seed=SEED)
    a, b = lora.a.bfloat16(), lora.b.bfloat16()
    stem = "lora_unet_" + MODULE.replace(".", "_")
    sd = {f"{stem}.lora_down.weight": a, f"{stem}.lora_up.weight": b, f"{stem}.alpha": torch.tensor(ALPHA)}
    x = torch.randn(1, 16, HIDDEN, generator=torch.Generator().manual_seed(SEED + 1)).bfloat16()
    before = stored(layer)
    with torch.no_grad():
        base = layer(x)
    model, _, report = load_lora_for_models(flux, None, sd, STRENGTH, 0.0)
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == 3, report.summary()
    state = model.get_attachment(KEY)
    state.inject()
    try:
        with torch.no_grad():
            ours = layer(x)
        during = stored(layer)
    finally:
        state.eject()
    with torch.no_grad():
        assert torch.equal(layer(x), base), "the path stayed on"
    for what, now in (("while injected", during), ("after", stored(layer))):
        assert now.keys() == before.keys() and len(before) >= 2, sorted(before)
        assert all(torch.equal(now[k], before[k]) for k in before), f"storage changed {what}"

    s = STRENGTH * ALPHA / RANK
    x64 = x.double().reshape(-1, HIDDEN)
    term = s * (x64 @ a.double().T) @ b.double().T
    magnitude = abs(s) * (x64.abs() @ a.double().abs().T) @ b.double().abs().T
    y = base.double().reshape(term.shape)
    tol = 2 * ulp(y.abs() + term.abs(), torch.bfloat16) + 4 * 2.0**-8 * term.abs().max()
    tol = tol + HIDDEN**0.5 * 2.0**-24 * magnitude
    err = (ours.double().reshape(term.shape) - y - term).abs()
    assert bool((err <= tol).all()), f"worst |err| - tol = {float((err - tol).max()):.3g}"
    assert float((term.abs() > tol).double().mean()) > 0.5, "the adapter is below the tolerance: a void check"
