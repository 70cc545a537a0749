"""Key parsing: every layout the foundation issue names splits into (component, module path, family, role)."""

from __future__ import annotations

import pytest
import torch

import loraweave
from loraweave.formats.keys import ParsedKey, parse_key, split_stem, underscore_form

CASES = [
    # key, component, path, family, role, layout
    (
        "lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight",
        "denoiser",
        "down_blocks_0_attentions_0_proj_in",
        "lora",
        "down",
        "kohya",
    ),
    (
        "lora_unet_input_blocks_4_1_proj_in.alpha",
        "denoiser",
        "input_blocks_4_1_proj_in",
        "lora",
        "alpha",
        "kohya",
    ),
    (
        "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
        "text_encoder",
        "text_model_encoder_layers_0_mlp_fc1",
        "lora",
        "up",
        "kohya",
    ),
    (
        "lora_te1_text_model_encoder_layers_9_self_attn_q_proj.lora_down.weight",
        "text_encoder",
        "text_model_encoder_layers_9_self_attn_q_proj",
        "lora",
        "down",
        "kohya",
    ),
    (
        "lora_te2_text_model_encoder_layers_9_self_attn_q_proj.lora_down.weight",
        "text_encoder_2",
        "text_model_encoder_layers_9_self_attn_q_proj",
        "lora",
        "down",
        "kohya",
    ),
    ("lora_unet_conv_in.lora_mid.weight", "denoiser", "conv_in", "lora", "mid", "kohya"),
    (
        "transformer.single_transformer_blocks.5.proj_mlp.lora_B.weight",
        "denoiser",
        "single_transformer_blocks.5.proj_mlp",
        "lora",
        "up",
        "peft",
    ),
    ("transformer.x_embedder.lora_A.default.weight", "denoiser", "x_embedder", "lora", "down", "peft"),
    ("base_model.model.proj_out.lora_A.weight", "denoiser", "proj_out", "lora", "down", "peft"),
    (
        "unet.down_blocks.0.resnets.0.conv1.lora_A.weight",
        "denoiser",
        "down_blocks.0.resnets.0.conv1",
        "lora",
        "down",
        "peft",
    ),
    (
        "text_encoder_2.text_model.encoder.layers.3.mlp.fc2.lora_B.weight",
        "text_encoder_2",
        "text_model.encoder.layers.3.mlp.fc2",
        "lora",
        "up",
        "peft",
    ),
    ("transformer.blocks.0.attn1.to_q.lora_A", "denoiser", "blocks.0.attn1.to_q", "lora", "down", "peft"),
    (
        "transformer.blocks.0.attn1.to_q.lora_B.bias",
        "denoiser",
        "blocks.0.attn1.to_q",
        "lora",
        "up_bias",
        "peft",
    ),
    (
        "down_blocks.2.attentions.1.transformer_blocks.6.attn2.processor.to_out_lora.down.weight",
        "denoiser",
        "down_blocks.2.attentions.1.transformer_blocks.6.attn2.to_out.0",
        "lora",
        "down",
        "diffusers_attn_processor",
    ),
    (
        "unet.mid_block.attentions.0.transformer_blocks.0.attn1.processor.to_k_lora.up.weight",
        "denoiser",
        "mid_block.attentions.0.transformer_blocks.0.attn1.to_k",
        "lora",
        "up",
        "diffusers_attn_processor",
    ),
    (
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora.down.weight",
        "denoiser",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
        "lora",
        "down",
        "diffusers_lora_layer",
    ),
    (
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_linear_layer.up.weight",
        "text_encoder",
        "text_model.encoder.layers.0.self_attn.q_proj",
        "lora",
        "up",
        "lora_linear_layer",
    ),
    (
        "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight",
        "denoiser",
        "double_blocks.0.img_attn.qkv",
        "lora",
        "down",
        "comfyui",
    ),
    (
        "model.diffusion_model.input_blocks.1.1.proj_in.lora_down.weight",
        "denoiser",
        "input_blocks.1.1.proj_in",
        "lora",
        "down",
        "comfyui",
    ),
    (
        "lycoris_single_transformer_blocks_17_attn_to_q.lokr_w1",
        "denoiser",
        "single_transformer_blocks_17_attn_to_q",
        "lokr",
        "lokr_w1",
        "lycoris",
    ),
    (
        "lora_transformer_transformer_blocks_0_attn_to_q.lora_down.weight",
        "denoiser",
        "transformer_blocks_0_attn_to_q",
        "lora",
        "down",
        "onetrainer",
    ),
    ("diffusion_model.head.head.diff", "denoiser", "head.head", "full", "diff", "comfyui"),
    ("diffusion_model.head.head.diff_b", "denoiser", "head.head", "full", "diff_b", "comfyui"),
    (
        "lora_unet_blocks_0_cross_attn_k.dora_scale",
        "denoiser",
        "blocks_0_cross_attn_k",
        "dora",
        "dora_scale",
        "kohya",
    ),
    ("lora_unet_x.hada_w1_a", "denoiser", "x", "loha", "hada_w1_a", "kohya"),
    ("lora_unet_x.oft_blocks", "denoiser", "x", "oft", "oft_blocks", "kohya"),
    ("unet:12:down", "denoiser", "unet:12", "lora", "down", "cloneofsimo"),
    ("text_encoder:3:up", "text_encoder", "text_encoder:3", "lora", "up", "cloneofsimo"),
]


@pytest.mark.parametrize("key, component, path, family, role, layout", CASES)
def test_parse_and_split(key, component, path, family, role, layout):
    parsed = parse_key(key)
    assert isinstance(parsed, ParsedKey), parsed
    assert (parsed.family, parsed.role) == (family, role)
    target = split_stem(parsed.stem)
    assert (target.component, target.path) == (component, path)
    adapter = loraweave.load_adapter({key: torch.zeros(1)})
    assert adapter.parts[0].layout == layout


@pytest.mark.parametrize("key", ["model.diffusion_model.input_blocks.0.0.weight", "<s1>", "something_random"])
def test_unknown_keys_get_a_reason(key):
    assert isinstance(parse_key(key), str)
    adapter = loraweave.load_adapter({key: torch.zeros(1)})
    assert adapter.parts == [] and adapter.unparsed[0]["key"] == key


def test_underscore_form_normalises_trainer_quirks():
    # SimpleTuner trailing `_`, Wan-Fun double `__`, half-dotted musubi keys all meet the dotted module name.
    name = underscore_form("transformer_blocks.10.attn.to_k")
    assert underscore_form("transformer_blocks_10_attn_to_k_") == name
    assert underscore_form("_transformer_blocks__10_attn_to_k") == name
    assert underscore_form("transformer_blocks_10.attn.to_k") == name


def test_ia3_weight_is_recognised_only_through_on_input():
    adapter = loraweave.load_adapter(
        {"lora_unet_x.weight": torch.ones(4), "lora_unet_x.on_input": torch.tensor(0)}
    )
    assert adapter.unparsed == [] and adapter.families == {"ia3": 1}


def test_lone_scale_key_is_a_norm_replacement_not_a_lora_scale():
    """BFL control LoRAs carry `*.norm.key_norm.scale` (a replacement weight): reported as the `set`
    family."""
    adapter = loraweave.load_adapter(
        {
            "single_blocks.0.norm.key_norm.scale": torch.ones(128),
            "x.lora_down.weight": torch.zeros(2, 4),
            "x.lora_up.weight": torch.zeros(4, 2),
            "x.scale": torch.tensor(0.5),
        }
    )
    families = {p.path: p.family for p in adapter.parts}
    assert families == {"single_blocks.0.norm.key_norm": "set", "x": "lora"}
