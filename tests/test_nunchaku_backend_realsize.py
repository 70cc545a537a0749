"""Real-size tier of the Nunchaku backend: one Flux-width `SVDQW4A4Linear` (3072 -> 12288, rank 32, bf16,
int4 groups of 64), as in Flux's `ff.net.0.proj`, with a rank-16 LoRA: it rides the low-rank branch exactly
(appended tiles == bf16 factors, base tiles untouched), the forward makes the same `nunchaku._C` calls, the
output change is the stored factors' term within the branch's bf16 roundings, that term the fp64 one within
the factors' bf16 storage rounding,
and `remove()` restores every tensor object and byte."""

from __future__ import annotations

import torch
from helpers import nunchaku_cpu as nc

import loraweave

U = 2.0**-8
IN, OUT, RANK = 3072, 12288, 16


def test_flux_width_layer_lora_exact_and_bit_exact_removal():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(OUT, 16, generator=g) @ torch.randn(16, IN, generator=g) / 16
    weight += 0.02 * torch.randn(OUT, IN, generator=g)
    root = torch.nn.Module()
    root.proj = nc.build_svdq_linear(weight, bias=0.1 * torch.randn(OUT, generator=g), rank=32)
    del weight
    layer = root.proj
    x = torch.randn(1, 24, IN, generator=g).to(torch.bfloat16)
    before = nc.storage(root)
    with torch.no_grad():
        calls = nc.CALLS.copy()
        base = layer(x)
        base_calls = nc.CALLS - calls
    down, up = torch.randn(RANK, IN, generator=g) * 0.3, torch.randn(OUT, RANK, generator=g) * 0.3
    sd = {"proj.lora_A.weight": down, "proj.lora_B.weight": up}  # PEFT names, no alpha: scale 1
    handle = loraweave.apply(root, sd, mode="auto", strict=True)
    (row,) = handle.report.applied
    assert (row.module, row.mechanism, row.backend, row.rank) == ("proj", "factor", "nunchaku", RANK)
    assert layer.rank == layer.proj_up.shape[1] == 32 + RANK
    got_down = nc.unpack_lowrank(layer.proj_down.detach(), down=True)
    got_up = nc.unpack_lowrank(layer.proj_up.detach(), down=False)
    assert torch.equal(got_down[32:], down.to(torch.bfloat16))
    assert torch.equal(got_up[:, 32:], up.to(torch.bfloat16))
    assert torch.equal(got_down[:32], nc.unpack_lowrank(before["proj.proj_down"][0].detach(), down=True))
    assert torch.equal(got_up[:, :32], nc.unpack_lowrank(before["proj.proj_up"][0].detach(), down=False))
    with torch.no_grad():
        calls = nc.CALLS.copy()
        out = layer(x)
        assert nc.CALLS - calls == base_calls == {"quantize_w4a4_act_fuse_lora": 1, "gemm_w4a4": 1}
    xd = x.double()
    a16, b16 = down.to(torch.bfloat16).double(), up.to(torch.bfloat16).double()
    stored = (xd @ a16.T) @ b16.T  # the term of the factors as stored (each rounded to bf16 once)
    exact = (xd @ down.double().T) @ up.double().T
    # running the stored factors: the branch input and the output are each rounded to bf16 once
    bound = U * (base.double().abs() + out.double().abs()) + U * (xd @ a16.T).abs() @ b16.abs().T
    err = (out.double() - base.double() - stored).abs()
    assert (err <= bound + 1e-6).all(), float((err / (bound + 1e-6)).max())
    assert float(((stored.abs() > bound + 1e-6).double()).mean()) > 0.5  # the bound cannot hide the term
    # storing the factors in bf16 moves the term by at most 2u·(|x|·|A|ᵀ)·|B|ᵀ from the fp64 one
    storage_bound = 2.01 * U * (xd.abs() @ down.double().abs().T) @ up.double().abs().T
    assert ((stored - exact).abs() <= storage_bound + 1e-9).all()
    handle.remove()
    nc.assert_storage(root, before)
    with torch.no_grad():
        assert torch.equal(layer(x), base)
