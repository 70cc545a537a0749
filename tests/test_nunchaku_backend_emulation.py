"""The CPU stand-in for `nunchaku._C` (tests/helpers/nunchaku_cpu.py) against nunchaku's own packers and the
float weights the layers were built from.

Bounds, stated per test: the unpackers invert nunchaku's packers exactly; an `SVDQW4A4Linear` built from W
holds W within half its int4 step (|W_layer - W| <= s_w/2 / smooth, elementwise); its emulated forward equals
x·W_layerᵀ + b within `svdq_error_bound` (int4 activation rounding s_a/2 per channel, plus the 16-bit
roundings the kernel makes, u = 2^-8 for bf16); an `AWQW4A16Linear` forward equals x·W_layerᵀ + b within one
16-bit rounding of the output.
"""

from __future__ import annotations

import pytest
import torch
from helpers import nunchaku_cpu as nc


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a few strong directions over a noise floor, as trained weights look (SVDQuant's low rank has work to do)
    low = torch.randn(n, 8, generator=g) @ torch.randn(8, k, generator=g) / 8
    return low + 0.02 * torch.randn(n, k, generator=g)


def _smooth(k: int, seed: int) -> torch.Tensor:
    return torch.exp(0.4 * torch.randn(k, generator=torch.Generator().manual_seed(seed)))


def test_unpackers_invert_nunchaku_packers():
    packer = nc.packer()
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (256, 384), generator=g, dtype=torch.int32)
    assert torch.equal(nc.unpack_weight(packer.pack_weight(q.clone())), q)
    scales = torch.rand(256, 6, generator=g).to(torch.bfloat16)
    assert torch.equal(nc.unpack_scale(packer.pack_scale(scales, group_size=64), 256), scales)
    vector = torch.randn(384, generator=g).to(torch.float16)
    assert torch.equal(nc.unpack_scale(packer.pack_scale(vector, group_size=-1), 384), vector)
    down, up = torch.randn(48, 384, generator=g).half(), torch.randn(256, 48, generator=g).half()
    assert torch.equal(nc.unpack_lowrank(packer.pack_lowrank_weight(down, down=True), down=True), down)
    assert torch.equal(nc.unpack_lowrank(packer.pack_lowrank_weight(up, down=False), down=False), up)
    pack_w4 = nc.import_nunchaku("nunchaku.models.text_encoders.tinychat_utils").pack_w4
    u4 = torch.randint(0, 16, (256, 384), generator=g, dtype=torch.int32)
    packed = pack_w4(u4.clone()).view(torch.int32).reshape(64, 192)
    assert torch.equal(nc.unpack_awq(packed, 256, 384), u4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_svdq_layer_holds_its_float_weight(dtype):
    n, k = 256, 384
    weight, smooth = _weight(n, k, 1), _smooth(k, 2)
    layer = nc.build_svdq_linear(weight, rank=32, dtype=dtype, smooth=smooth)
    assert type(layer).__module__ == "nunchaku.models.linear"  # the real class
    parts = nc.svdq_parts(layer)
    step = parts["wscales"].repeat_interleave(nc.GROUP, dim=1) / parts["smooth"]
    err = (nc.svdq_weight(layer) - weight.double()).abs()
    assert (err <= step / 2 * (1 + 1e-6) + 1e-9).all(), float((err / step).max())
    # the low-rank branch carries the strong directions: the residual grid is finer than the weight's own
    assert float(step.max()) < float(weight.abs().max()) / 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_svdq_forward_is_the_float_weight_within_int4_activation_rounding(dtype):
    n, k = 256, 384
    weight, bias = _weight(n, k, 3), torch.randn(n, generator=torch.Generator().manual_seed(4))
    layer = nc.build_svdq_linear(weight, bias=bias, rank=32, dtype=dtype, smooth=_smooth(k, 5))
    x = torch.randn(2, 7, k, generator=torch.Generator().manual_seed(6)).to(dtype)
    before = nc.CALLS.copy()
    out = layer(x)
    calls = nc.CALLS - before
    assert calls == {"quantize_w4a4_act_fuse_lora": 1, "gemm_w4a4": 1}
    assert out.shape == (2, 7, n) and out.dtype == dtype
    reference = x.double() @ nc.svdq_weight(layer).T + nc.svdq_parts(layer)["bias"]
    bound = nc.svdq_error_bound(layer, x)
    err = (out.double() - reference).abs()
    assert (err <= bound).all(), float((err / bound).max())
    # the bound is the int4 activation step, not a blanket: well under the output's scale
    assert float(bound.max()) < 0.1 * float(reference.abs().max())
    # and the layer is the float weight's output to within that step plus the weight grid
    from_float = x.double() @ weight.double().T + bias.to(dtype).double()
    assert float((out.double() - from_float).abs().max()) < 0.1 * float(from_float.abs().max())


def test_awq_forward_is_its_float_weight():
    n, k = 256, 384
    weight, bias = _weight(n, k, 7), torch.randn(n, generator=torch.Generator().manual_seed(8))
    layer = nc.build_awq_linear(weight, bias=bias, dtype=torch.bfloat16)
    assert type(layer).__name__ == "AWQW4A16Linear"
    scale = layer.wscales.T.double().repeat_interleave(64, dim=1)
    zeros = layer.wzeros.T.double().repeat_interleave(64, dim=1)
    # asymmetric uint4: half a step, the stored scale's and zero's bf16 rounding (15 steps of u each)
    grid_err = (nc.awq_weight(layer) - weight.double()).abs()
    assert (grid_err <= scale * (0.5 + 16 * 2.0**-8) + zeros.abs() * 2.0**-8 + 1e-7).all()
    x = torch.randn(3, 5, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    before = nc.CALLS.copy()
    out = layer(x)
    assert nc.CALLS - before == {"gemv_awq": 1}
    reference = x.double() @ nc.awq_weight(layer).T
    # output rounded to bf16 once before the bias add, once after (u = 2^-8 each)
    bound = 2.0**-8 * (reference.abs() + (reference + layer.bias.double()).abs()) * 1.001 + 1e-6
    err = (out.double() - reference - layer.bias.double()).abs()
    assert (err <= bound).all(), float((err / bound).max())
