"""BFL control LoRAs (Flux Canny/Depth) grow the model: `img_in` takes twice the channels (image + control).

Reference: a Flux built with the wider input by hand (base weights copied, zero columns for the control
channels, the LoRA added by formula); ours must match its output, and removal must give back the exact
model. Where the model is not fed latents + one control latent (Flux Fill's x_embedder takes 384: latents,
masked-image latents, mask; Chroma takes no control input), the control LoRA is refused with
OtherInputError naming the file and its img_in keys, whatever strict, the model bit-equal afterwards."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.arch_matrix import ARCHS
from helpers.common import gen, rel_err
from helpers.family_models import _control_lora
from helpers.tiny_models import tiny_flux
from safetensors.torch import save_file

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


def _fill():
    """Flux Fill's input widths (x_embedder 384 = latents 64 | masked-image latents 64 | mask 256, proj_out
    64) at a tiny hidden width."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=384,
        out_channels=64,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
        guidance_embeds=True,
    ).eval()


def _canny_for(model, latents: int) -> dict[str, torch.Tensor]:
    """A BFL control LoRA trained on a Flux taking `latents` columns: img_in 2 x latents wide."""
    g = gen(11)
    hidden = model.x_embedder.weight.shape[0]
    return {
        "img_in.lora_A.weight": torch.randn(4, 2 * latents, generator=g) * 0.3,
        "img_in.lora_B.weight": torch.randn(hidden, 4, generator=g) * 0.3,
        "img_in.lora_B.bias": torch.randn(hidden, generator=g) * 0.1,
        "double_blocks.0.img_attn.proj.lora_A.weight": torch.randn(4, hidden, generator=g) * 0.3,
        "double_blocks.0.img_attn.proj.lora_B.weight": torch.randn(hidden, 4, generator=g) * 0.3,
    }


def _refused_and_unchanged(model, sd, tmp_path, **kwargs) -> str:
    """apply refuses `sd` (written to a file) with OtherInputError naming the file and img_in's keys; the
    model's tensors, config and x_embedder are as before. The message comes back."""
    path = tmp_path / "canny.safetensors"
    save_file(sd, str(path))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config, embedder = dict(model.config), model.x_embedder.weight
    with pytest.raises(loraweave.OtherInputError) as caught:
        loraweave.apply(model, str(path), **kwargs)
    message = str(caught.value)
    assert str(path) in message and all(k in message for k in sd if k.startswith("img_in."))
    assert model.x_embedder.weight is embedder and dict(model.config) == config
    assert model.state_dict().keys() == before.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    return message


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", ["merge", "runtime", "auto"])
def test_control_lora_on_flux_fill_is_refused(mode, strict, tmp_path):
    fill = _fill()
    sd = _canny_for(fill, 64)
    message = _refused_and_unchanged(fill, sd, tmp_path, mode=mode, strict=strict)
    assert "trained on 128 input columns" in message and "takes 384" in message
    report = loraweave.plan(fill, sd)  # a dry run says why, key by key
    assert {u["key"] for u in report.unmatched if u["kind"] == "other_input"} == {
        k for k in sd if k.startswith("img_in.")
    }


def test_switch_to_a_control_lora_on_flux_fill_is_refused():
    fill = _fill()
    g = gen(3)
    plain = {
        "double_blocks.0.img_attn.proj.lora_A.weight": torch.randn(4, 32, generator=g),
        "double_blocks.0.img_attn.proj.lora_B.weight": torch.randn(32, 4, generator=g) * 0.1,
    }
    handle = loraweave.apply(fill, plain, mode="merge")
    merged = {k: v.clone() for k, v in fill.state_dict().items()}
    with pytest.raises(loraweave.OtherInputError, match="img_in.lora_A.weight"):
        handle.switch([_canny_for(fill, 64)])
    assert all(torch.equal(v, merged[k]) for k, v in fill.state_dict().items())
    assert fill.x_embedder.in_features == 384


def test_control_lora_on_chroma_is_refused(tmp_path):
    chroma = ARCHS["chroma"]()
    latents = chroma.proj_out.weight.shape[0]
    assert chroma.x_embedder.in_features == latents
    message = _refused_and_unchanged(chroma, _canny_for(chroma, latents), tmp_path, mode="merge")
    assert f"from {latents} to {2 * latents}" in message and "it takes no control input" in message


def test_a_base_lora_still_pads_into_fill():
    """The other declared relation (the control one: test_control_lora_grows_x_embedder): trained on the
    latents alone (64), zero-padded into Fill's 384."""
    fill = _fill()
    g = gen(5)
    base = {
        "img_in.lora_A.weight": torch.randn(4, 64, generator=g),
        "img_in.lora_B.weight": torch.randn(32, 4, generator=g) * 0.1,
    }
    before = fill.x_embedder.weight.detach().clone()
    handle = loraweave.apply(fill, base, mode="merge", strict=True)
    want = before.clone()
    want[:, :64] += base["img_in.lora_B.weight"] @ base["img_in.lora_A.weight"]
    assert rel_err(fill.x_embedder.weight, want) <= 1e-6
    assert torch.equal(fill.x_embedder.weight[:, 64:], before[:, 64:])
    handle.remove()
    assert torch.equal(fill.x_embedder.weight, before)
