"""Weight replacement (`set_weight`, BFL control LoRAs' `*_norm.scale`): W <- t outright, strength ignored."""

from __future__ import annotations

import copy

import torch
from helpers.common import rel_err
from helpers.tiny_models import flux_forward, tiny_flux

import loraweave


def test_bfl_norm_scale_replaces_the_rms_norm_weight_merge_and_runtime():
    base = tiny_flux()
    g = torch.Generator().manual_seed(2)
    sd = {
        "single_blocks.1.norm.key_norm.scale": 1 + torch.randn(16, generator=g) * 0.3,
        "double_blocks.0.txt_attn.norm.query_norm.scale": 1 + torch.randn(16, generator=g) * 0.3,
    }
    with torch.no_grad():
        plain = flux_forward(base)
        outs = {}
        for mode, strength in (("merge", 1.0), ("runtime", 1.0), ("merge", 0.5)):
            model = copy.deepcopy(base)
            handle = loraweave.apply(model, sd, mode=mode, strength=strength, strict=True)
            assert {m.module for m in handle.report.applied} == {
                "single_transformer_blocks.1.attn.norm_k",
                "transformer_blocks.0.attn.norm_added_q",
            }
            if mode == "merge":  # replaced outright, whatever the strength
                assert torch.equal(
                    model.single_transformer_blocks[1].attn.norm_k.weight,
                    sd["single_blocks.1.norm.key_norm.scale"],
                )
            outs[(mode, strength)] = flux_forward(model)
            handle.remove()
            assert torch.equal(flux_forward(model), plain)
    assert rel_err(outs[("runtime", 1.0)], outs[("merge", 1.0)]) <= 1e-5
    assert torch.equal(outs[("merge", 0.5)], outs[("merge", 1.0)])
    assert float((outs[("merge", 1.0)] - plain).abs().max()) > 1e-4


def test_set_weight_on_a_linear():
    model = torch.nn.Sequential(torch.nn.Linear(6, 4))
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 6)
    runtime = copy.deepcopy(model)
    handle = loraweave.apply(model, {"0.set_weight": t}, mode="merge", strict=True)
    assert torch.equal(model[0].weight, t)
    h2 = loraweave.apply(runtime, {"0.set_weight": t}, mode="runtime", strict=True)
    assert "strength ignored" in h2.report.applied[0].cost
    with torch.no_grad():
        assert rel_err(runtime(x), model(x)) <= 1e-5
    handle.remove()
