"""BFL control LoRAs (Flux Canny/Depth) grow the model: `img_in` takes twice the channels (image + control).

Reference: a Flux built with the wider input by hand (base weights copied, zero columns for the control
channels, the LoRA added by formula); ours must match its output, and removal must give back the exact
model."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.common import gen, rel_err
from helpers.family_models import _control_lora
from helpers.tiny_models import tiny_flux

import loraweave


def _forward(model, channels: int, seed: int = 1):
    g = gen(seed)
    return model(
        hidden_states=torch.randn(1, 16, channels, generator=g),
        encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(5, 3),
        return_dict=False,
    )[0]


def _reference(base, sd):
    from diffusers import FluxTransformer2DModel

    cfg = {k: v for k, v in base.config.items() if not k.startswith("_")}
    cfg["in_channels"], cfg["out_channels"] = 2 * cfg["in_channels"], base.out_channels
    ref = FluxTransformer2DModel.from_config(cfg).eval()
    state = base.state_dict()
    w = state["x_embedder.weight"]
    state["x_embedder.weight"] = torch.cat([w, torch.zeros_like(w)], dim=1)
    state["x_embedder.weight"] += sd["img_in.lora_B.weight"] @ sd["img_in.lora_A.weight"]
    state["x_embedder.bias"] = state["x_embedder.bias"] + sd["img_in.lora_B.bias"]
    proj = "transformer_blocks.0.attn.to_out.0.weight"
    state[proj] = (
        state[proj]
        + sd["double_blocks.0.img_attn.proj.lora_B.weight"]
        @ sd["double_blocks.0.img_attn.proj.lora_A.weight"]
    )
    ref.load_state_dict(state)
    return ref


@pytest.mark.parametrize("with_reshape", [False, True])
@pytest.mark.parametrize("mode", ["merge", "runtime", "auto"])
def test_control_lora_grows_x_embedder(mode, with_reshape):
    base = tiny_flux()
    model = copy.deepcopy(base)
    original = model.x_embedder.weight
    sd = _control_lora(base, with_reshape)
    handle = loraweave.apply(model, sd, mode=mode, strict=True)
    assert handle.report.keys_applied == len(sd)
    notes = [n for m in handle.report.applied for n in m.notes]
    assert any("input grown 16 -> 32" in n for n in notes), notes
    assert model.config.in_channels == 32 and model.x_embedder.in_features == 32
    with torch.no_grad():
        assert rel_err(_forward(model, 32), _forward(_reference(base, sd), 32)) <= 1e-5
    handle.remove()
    assert model.x_embedder.weight is original and model.x_embedder.in_features == 16
    assert model.config.in_channels == 16 and model.config.out_channels is None
    for (name, a), b in zip(model.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_reshape_weight_on_a_module_that_cannot_grow_is_reported():
    base = tiny_flux()
    hidden = base.transformer_blocks[0].attn.to_out[0].weight.shape[0]
    sd = {
        "double_blocks.0.img_attn.proj.lora_A.weight": torch.zeros(4, hidden),
        "double_blocks.0.img_attn.proj.lora_B.weight": torch.zeros(hidden, 4),
        "double_blocks.0.img_attn.proj.reshape_weight": torch.tensor([hidden, 2 * hidden]),
    }
    report = loraweave.plan(base, sd)
    assert len(report.unmatched) == 3
    assert all("only declared model inputs can grow" in u["reason"] for u in report.unmatched)


def test_plan_on_meta_model_notes_the_growth():
    with torch.device("meta"):
        base = tiny_flux()
    sd = {k: torch.empty(v.shape, device="meta") for k, v in _control_lora(tiny_flux(), False).items()}
    report = loraweave.plan(base, sd)
    assert report.ok
    assert any("input grown" in n for m in report.applied for n in m.notes)
