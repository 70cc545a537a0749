"""Targets: a diffusers-style pipeline (components), a mapping, a bare module; text encoders via kohya
names."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import tiny_sdxl_unet

import loraweave
from loraweave.errors import TargetError


def tiny_clip(seed: int = 0):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    cfg = CLIPTextConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=100,
        max_position_embeddings=16,
    )
    return CLIPTextModel(cfg).eval()


class FakePipeline:
    """What loraweave reads from a diffusers DiffusionPipeline: its `components` mapping."""

    def __init__(self, **components) -> None:
        self.components = components


def _lora(sd: dict, stem: str, out_rows: int, in_dim: int, seed: int, alpha: float | None = None):
    g = torch.Generator().manual_seed(seed)
    sd[f"{stem}.lora_down.weight"] = torch.randn(4, in_dim, generator=g)
    sd[f"{stem}.lora_up.weight"] = torch.randn(out_rows, 4, generator=g)
    if alpha is not None:
        sd[f"{stem}.alpha"] = torch.tensor(alpha)


def test_pipeline_components_with_kohya_unet_and_text_encoder():
    unet, te = tiny_sdxl_unet(), tiny_clip()
    pipe = FakePipeline(
        unet=copy.deepcopy(unet), text_encoder=copy.deepcopy(te), tokenizer=None, scheduler=object()
    )
    sd: dict[str, torch.Tensor] = {}
    _lora(sd, "lora_te_text_model_encoder_layers_1_self_attn_q_proj", 32, 32, 1, alpha=2.0)
    _lora(sd, "lora_te_text_model_encoder_layers_0_mlp_fc1", 64, 32, 2, alpha=8.0)
    _lora(sd, "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k", 32, 32, 3, alpha=4.0)  # sgm name
    _lora(sd, "lora_te2_text_model_encoder_layers_0_mlp_fc1", 64, 32, 4)  # the pipeline has no text_encoder_2
    handle = loraweave.apply(pipe, sd, mode="merge")
    assert handle.report.counts() == {"text_encoder": {"merge": 2}, "unet": {"merge": 1}}
    assert {u["reason"].split(":")[0] for u in handle.report.unmatched} == {"no such component"}
    assert len(handle.report.unmatched) == 2
    te_mods, unet_mods = (
        dict(pipe.components["text_encoder"].named_modules()),
        dict(pipe.components["unet"].named_modules()),
    )
    ref_te, ref_unet = dict(te.named_modules()), dict(unet.named_modules())

    def check(mods, refs, path, stem, gamma):
        down, up = sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"]
        want = refs[path].weight + gamma * up @ down
        assert torch.allclose(mods[path].weight, want, rtol=0, atol=1e-6), path

    prefix = "text_model." if "text_model.encoder.layers.1.self_attn.q_proj" in te_mods else ""
    check(
        te_mods,
        ref_te,
        f"{prefix}encoder.layers.1.self_attn.q_proj",
        "lora_te_text_model_encoder_layers_1_self_attn_q_proj",
        0.5,
    )
    check(
        te_mods,
        ref_te,
        f"{prefix}encoder.layers.0.mlp.fc1",
        "lora_te_text_model_encoder_layers_0_mlp_fc1",
        2.0,
    )
    check(
        unet_mods,
        ref_unet,
        "down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k",
        "lora_unet_input_blocks_4_1_transformer_blocks_0_attn2_to_k",
        1.0,
    )
    handle.remove()
    for a, b in zip(pipe.components["unet"].parameters(), unet.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bare_module_target_reports_text_encoder_keys_as_missing_component():
    sd: dict[str, torch.Tensor] = {}
    _lora(sd, "lora_te_text_model_encoder_layers_0_mlp_fc1", 64, 32, 1)
    report = loraweave.plan(tiny_sdxl_unet(), sd)
    assert report.keys_applied == 0
    assert all(u["reason"].startswith("no such component: text_encoder") for u in report.unmatched)


def test_bad_targets_raise_typed_errors():
    with pytest.raises(TargetError):
        loraweave.plan(object(), {})
    with pytest.raises(TargetError):
        loraweave.plan({"unet": "not a module"}, {})


def test_nested_merges_must_be_removed_in_reverse_order():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    before = model[0].weight.detach().clone()
    sd1: dict[str, torch.Tensor] = {}
    sd2: dict[str, torch.Tensor] = {}
    _lora(sd1, "0", 8, 8, 1)
    _lora(sd2, "0", 8, 8, 2)
    h1 = loraweave.apply(model, sd1, mode="merge", strict=True)
    h2 = loraweave.apply(model, sd2, mode="merge", strict=True)
    with pytest.raises(RuntimeError, match="reverse order"):
        h1.remove()
    with pytest.raises(RuntimeError, match="later apply"):
        h1.set_strength("adapter", 0.5)
    h2.remove()
    h1.remove()
    assert torch.equal(model[0].weight, before)
