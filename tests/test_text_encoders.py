"""Text-encoder LoRAs on transformers' CLIP, T5 and Qwen3 classes built tiny from config."""

from __future__ import annotations

import torch
from helpers.tiny_clip import _delta, _lora, tiny_clip

import loraweave


def tiny_t5():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    return T5EncoderModel(
        T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4)
    ).eval()


def test_flux_pipeline_t5_under_te2_and_te3_spellings():
    """OneTrainer writes T5 as `lora_te2_`; SD3-style files say `lora_te3_`: on a Flux pipeline both are
    T5."""
    t5 = tiny_t5()
    clip = tiny_clip()
    q = dict(t5.named_modules())["encoder.block.1.layer.0.SelfAttention.q"]
    wi = dict(t5.named_modules())["encoder.block.0.layer.1.DenseReluDense.wi"]
    before_q, before_wi = q.weight.detach().clone(), wi.weight.detach().clone()
    sd: dict[str, torch.Tensor] = {}
    _lora(sd, "lora_te2_encoder_block_1_layer_0_SelfAttention_q", q, 1)
    _lora(sd, "lora_te3_encoder_block_0_layer_1_DenseReluDense_wi", wi, 2)
    handle = loraweave.apply(
        {"transformer": torch.nn.Linear(2, 2), "text_encoder": clip, "text_encoder_2": t5},
        sd,
        mode="merge",
        strict=True,
    )
    assert handle.report.counts() == {"text_encoder_2": {"merge": 2}}
    assert torch.allclose(
        q.weight, before_q + _delta(sd, "lora_te2_encoder_block_1_layer_0_SelfAttention_q"), atol=1e-6
    )
    assert torch.allclose(
        wi.weight, before_wi + _delta(sd, "lora_te3_encoder_block_0_layer_1_DenseReluDense_wi"), atol=1e-6
    )


def test_qwen3_text_encoder_under_lora_te():
    """kohya Anima files name Qwen3 layers without the `model.` level that ForCausalLM adds."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

    cfg = Qwen3Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    for cls in (Qwen3Model, Qwen3ForCausalLM):
        torch.manual_seed(0)
        model = cls(cfg).eval()
        mods = dict(model.named_modules())
        name = "layers.1.self_attn.k_proj" if cls is Qwen3Model else "model.layers.1.self_attn.k_proj"
        before = mods[name].weight.detach().clone()
        sd: dict[str, torch.Tensor] = {}
        _lora(sd, "lora_te_layers_1_self_attn_k_proj", mods[name], 3)
        _lora(
            sd,
            "lora_te_layers_0_mlp_gate_proj",
            mods[name.replace("1.self_attn.k_proj", "0.mlp.gate_proj")],
            4,
        )
        handle = loraweave.apply({"text_encoder": model}, sd, mode="merge", strict=True)
        assert handle.report.keys_applied == len(sd)
        assert torch.allclose(
            mods[name].weight, before + _delta(sd, "lora_te_layers_1_self_attn_k_proj"), atol=1e-6
        )
        with torch.no_grad():
            handle.remove()
        assert torch.equal(mods[name].weight, before)


def test_runtime_on_t5_matches_merge():
    t5 = tiny_t5()
    sd: dict[str, torch.Tensor] = {}
    for i, (name, mod) in enumerate(n for n in t5.named_modules() if isinstance(n[1], torch.nn.Linear)):
        _lora(sd, "lora_te2_" + name.replace(".", "_"), mod, i)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(9))
    import copy

    merged, runtime = copy.deepcopy(t5), copy.deepcopy(t5)
    with torch.no_grad():
        loraweave.apply({"text_encoder_2": merged}, sd, mode="merge", strict=True)
        loraweave.apply({"text_encoder_2": runtime}, sd, mode="runtime", strict=True)
        a = merged(input_ids=ids).last_hidden_state
        b = runtime(input_ids=ids).last_hidden_state
        base = t5(input_ids=ids).last_hidden_state
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-5
    assert float((a - base).abs().max()) > 1e-3


def tiny_qwen25_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=128,
        bos_token_id=0,
        eos_token_id=1,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        fullatt_block_indexes=[0],
    )
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision)).eval()


def test_qwen25_vl_text_encoder_spellings():
    """Qwen-Image's TE: kohya/ComfyUI name decoder paths bare, older transformers had no `language_model.`
    level."""
    model = tiny_qwen25_vl()
    mods = dict(model.named_modules())
    spellings = {
        "lora_te_layers_1_self_attn_k_proj": "model.language_model.layers.1.self_attn.k_proj",
        "text_encoder.model.layers.0.mlp.up_proj": "model.language_model.layers.0.mlp.up_proj",
        "text_encoder.model.language_model.layers.1.mlp.down_proj": (
            "model.language_model.layers.1.mlp.down_proj"
        ),
        "text_encoder.visual.blocks.0.attn.qkv": "model.visual.blocks.0.attn.qkv",
    }
    before = {name: mods[name].weight.detach().clone() for name in spellings.values()}
    sd: dict[str, torch.Tensor] = {}
    for i, (stem, name) in enumerate(spellings.items()):
        _lora(sd, stem, mods[name], 10 + i)
    handle = loraweave.apply(
        {"transformer": torch.nn.Linear(2, 2), "text_encoder": model}, sd, mode="merge", strict=True
    )
    assert handle.report.counts() == {"text_encoder": {"merge": len(spellings)}}
    for stem, name in spellings.items():
        assert torch.allclose(mods[name].weight, before[name] + _delta(sd, stem), atol=1e-6), stem
    handle.remove()
    assert all(torch.equal(mods[n].weight, before[n]) for n in spellings.values())
