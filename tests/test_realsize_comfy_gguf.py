"""One full-width GGUF Flux layer through the pack: ComfyUI's Flux.1-dev on the meta device (helpers/
realsize_comfy.py) with `double_blocks.0.img_mlp.0` (3072 -> 12288) replaced by ComfyUI-GGUF's own
GGMLOps.Linear holding Q4_K blocks (packed by helpers/comfy_gguf.py `pack_k`; the gguf package cannot
quantize K-quants) and an F32 bias, as UnetLoaderGGUF builds it. A rank-16 kohya LoRA in `auto` runs at
runtime; the layer's output equals its own Q4_K output plus s·B·A·x in fp64 within 2⁻²² of |ref| plus the
fp32 accumulation bound √(in + r)·2⁻²⁴·|s|·|B|·|A|·|x|; the Q4_K bytes are unchanged while applied and
after."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import comfy_gguf as cg
from helpers.realsize_comfy import meta_flux_patcher

from loraweave.comfy import load_lora_for_models

pytestmark = [pytest.mark.realsize, pytest.mark.comfy]
HIDDEN, MLP = 3072, 12288
MODULE = "double_blocks.0.img_mlp.0"
RANK, ALPHA, STRENGTH = 16, 8.0, 0.8


def ggml_linear(seed: int = 5) -> torch.nn.Module:
    """GGMLOps.Linear(3072, 12288) with a Q4_K weight (seeded, trained-weight scale) and an F32 bias."""
    import gguf

    ops = cg.gguf_pack().ops
    g = np.random.default_rng(seed)
    w = (g.standard_normal((MLP, HIDDEN)) * 0.02).astype(np.float32)
    blocks = torch.from_numpy(cg.quantize(w, "Q4_K"))
    layer = ops.GGMLOps.Linear(HIDDEN, MLP)
    q4k = gguf.GGMLQuantizationType.Q4_K
    weight = ops.GGMLTensor(blocks, tensor_type=q4k, tensor_shape=torch.Size((MLP, HIDDEN)))
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.from_numpy(g.standard_normal(MLP).astype(np.float32) * 0.01))
    return layer


def test_full_width_q4k_layer_runtime_exact_and_bytes_unchanged():
    patcher = meta_flux_patcher(torch.float32)
    layer = ggml_linear()
    patcher.model.diffusion_model.double_blocks[0].img_mlp[0] = layer
    g = torch.Generator().manual_seed(11)
    down = torch.randn(RANK, HIDDEN, generator=g) * 0.02
    up = torch.randn(MLP, RANK, generator=g) * 0.02
    stem = "diffusion_model." + MODULE
    sd = {
        f"{stem}.lora_down.weight": down,
        f"{stem}.lora_up.weight": up,
        f"{stem}.alpha": torch.tensor(ALPHA),
    }
    x = torch.randn(2, 64, HIDDEN, generator=g)
    before = torch.Tensor(layer.weight).view(torch.uint8).clone()
    with torch.no_grad():
        base = layer(x)
    model, _, report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0)
    assert report.mode == "runtime" and report.keys_applied == report.keys_total == 3
    (row,) = report.applied
    assert row.backend == "comfy_gguf" and row.module == MODULE
    state = model.get_attachment("loraweave")
    state.inject()
    try:
        with torch.no_grad():
            ours = layer(x)
        assert torch.equal(torch.Tensor(layer.weight).view(torch.uint8), before)
    finally:
        state.eject()
    assert torch.equal(torch.Tensor(layer.weight).view(torch.uint8), before)
    s = STRENGTH * ALPHA / RANK
    x64 = x.double()
    term = s * (x64 @ down.double().T) @ up.double().T
    ref = base.double() + term
    accumulation = (
        (HIDDEN + RANK) ** 0.5
        * 2.0**-24
        * abs(s)
        * (x64.abs() @ down.double().abs().T)
        @ (up.double().abs().T)
    )
    bound = 2.0**-22 * ref.abs() + accumulation
    err = (ours.double() - ref).abs()
    assert (err <= bound).all(), (err - bound).max().item()
    assert (term.abs() > bound).float().mean() > 0.5  # the term exceeds the bound: the check can fail
    with torch.no_grad():
        assert torch.equal(layer(x), base)  # ejected: the layer is its own again
