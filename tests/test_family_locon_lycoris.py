"""LoRA/LoCon (incl. Tucker `lora_mid`) against LyCORIS 4's own wrapped forward, merged and at runtime.

Layers: Linear, Conv1d, Conv2d 3x3 (stride 2), Conv3d, 1x1 Conv2d. Alpha != rank everywhere; multipliers 1,
0.5, -1. Tolerance: rel. error <= 1e-5 (fp32) on the outputs and on the adapter's share of them."""

from __future__ import annotations

import copy

import lycoris  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
from helpers.common import multiplier_outputs, outputs, randomise, rel_err, save_lycoris, write_preset
from helpers.family_models import LAYERS, MULTIPLIERS, TOL, Net, inputs

import loraweave

OPTIONS = [
    ("default", {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 3, "conv_alpha": 5.0}),
    ("tucker", {"linear_dim": 4, "linear_alpha": 7.0, "conv_dim": 3, "conv_alpha": 1.5, "use_tucker": True}),
]


@pytest.mark.parametrize("opt_id, kwargs", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_locon_matches_lycoris_wrapped_forward(tmp_path, lycoris_state, opt_id, kwargs):
    pristine = Net()
    xs = inputs()
    base = outputs(pristine, xs)
    wrapped = copy.deepcopy(pristine)
    net = lycoris.create_lycoris(
        wrapped, 1.0, algo="locon", preset=write_preset(tmp_path / "p.toml"), **kwargs
    )
    net.apply_to()
    randomise((p for m in net.loras for p in m.parameters()), seed=2, scale=0.5)  # LyCORIS zero-inits lora_up
    refs = multiplier_outputs(net, wrapped, xs, MULTIPLIERS)
    path = tmp_path / "locon.safetensors"
    saved = save_lycoris(net, path)
    assert any(k.endswith(".lora_mid.weight") for k in saved) == ("use_tucker" in kwargs)
    for m in MULTIPLIERS:
        got = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = loraweave.apply(model, str(path), mode=mode, strength=m, strict=True)
            assert handle.report.keys_applied == handle.report.keys_total == len(saved)
            got[mode] = outputs(model, xs)
            for name in LAYERS:
                ref, ours = refs[m][name], got[mode][name]
                assert float((ref - base[name]).abs().max()) > 1e-3, f"{name}: no visible effect"
                assert rel_err(ours, ref) <= TOL, (mode, m, name)
                assert rel_err(ours - base[name], ref - base[name]) <= TOL, (mode, m, name)
            handle.remove()
