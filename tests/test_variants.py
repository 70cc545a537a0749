"""Variants: one file on Wan 2.2's two experts with per-expert strengths, and keys only a sibling variant has
(Wan 2.1 I2V image cross-attention on T2V/2.2, Flux dev's guidance embedder on schnell) reported as expected
absent, which strict mode does not count. Every other miss still counts."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_configs import tiny_wan

import loraweave
from loraweave import AdapterSpec
from loraweave.errors import ArgumentError, StrictApplyError, TargetError


def _lora(
    model: torch.nn.Module, names: dict[str, str], seed: int = 3, rank: int = 2
) -> dict[str, torch.Tensor]:
    """A kohya/musubi-style LoRA: {file name: live module} -> lora_down/up with alpha = rank."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    sd = {}
    for file_name, live in names.items():
        w = modules[live].weight
        sd[f"diffusion_model.{file_name}.lora_down.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.1
        sd[f"diffusion_model.{file_name}.lora_up.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.1
    return sd


WAN_KEYS = {
    "blocks.0.self_attn.q": "blocks.0.attn1.to_q",
    "blocks.1.ffn.2": "blocks.1.ffn.net.2",
    "blocks.0.cross_attn.k_img": "blocks.0.attn2.add_k_proj",
    "blocks.1.cross_attn.v_img": "blocks.1.attn2.add_v_proj",
}


def _delta(sd, stem):
    return sd[f"diffusion_model.{stem}.lora_up.weight"] @ sd[f"diffusion_model.{stem}.lora_down.weight"]


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_one_file_two_experts_with_their_own_strengths(mode):
    high, low = tiny_wan(False), tiny_wan(False)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in low.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    sd = _lora(tiny_wan(True), WAN_KEYS)
    before = {n: {k: v.clone() for k, v in m.state_dict().items()} for n, m in (("high", high), ("low", low))}
    spec = AdapterSpec(sd, component_strengths={"transformer": 1.0, "transformer_2": 0.5})
    h = loraweave.apply({"transformer": high, "transformer_2": low}, spec, mode=mode)
    rep = h.report.to_dict()
    # k_img / v_img exist only in Wan 2.1 I2V: expected absent on both experts, never counted as applied.
    absent = [u for u in rep["unmatched"] if u.get("kind") == "expected_absent"]
    assert len(absent) == len(rep["unmatched"]) == 8
    assert all(u["reason"].startswith("expected absent:") for u in absent)
    assert {u["reason"].split()[2].split(".")[0] for u in absent} == {"transformer", "transformer_2"}
    assert rep["keys_applied"] == 4 and rep["keys_total"] == 8 and h.report.ok
    assert {(m["component"], m["module"]) for m in rep["applied"]} == {
        (c, m)
        for c in ("transformer", "transformer_2")
        for m in ("blocks.0.attn1.to_q", "blocks.1.ffn.net.2")
    }
    q = _delta(sd, "blocks.0.self_attn.q")

    def effective(model, name):
        module = dict(model.named_modules())[name]
        eye = torch.eye(module.in_features)
        return module(eye).T - module.bias[:, None] if mode == "runtime" else module.weight.detach()

    with torch.no_grad():
        assert torch.allclose(
            effective(high, "blocks.0.attn1.to_q"),
            before["high"]["blocks.0.attn1.to_q.weight"] + q,
            rtol=1e-5,
            atol=1e-6,
        )
        assert torch.allclose(
            effective(low, "blocks.0.attn1.to_q"),
            before["low"]["blocks.0.attn1.to_q.weight"] + 0.5 * q,
            rtol=1e-5,
            atol=1e-6,
        )
        h.set_strength(next(iter(h.strengths)), 2.0)
        assert torch.allclose(
            effective(low, "blocks.0.attn1.to_q"),
            before["low"]["blocks.0.attn1.to_q.weight"] + q,
            rtol=1e-5,
            atol=1e-6,
        )
    h.remove()
    for name, model in (("high", high), ("low", low)):
        assert all(torch.equal(v, before[name][k]) for k, v in model.state_dict().items())


def test_default_is_the_first_expert_only_and_names_must_exist():
    high, low = tiny_wan(False), tiny_wan(False)
    sd = _lora(high, {k: v for k, v in WAN_KEYS.items() if "img" not in k})
    rep = loraweave.plan({"transformer": high, "transformer_2": low}, sd)
    assert {m.component for m in rep.applied} == {"transformer"}
    only_low = loraweave.plan(
        {"transformer": high, "transformer_2": low},
        AdapterSpec(sd, component_strengths={"transformer_2": 1.0}),
    )
    assert {m.component for m in only_low.applied} == {"transformer_2"}
    with pytest.raises(TargetError, match="transformer_3"):
        loraweave.plan({"transformer": high}, AdapterSpec(sd, component_strengths={"transformer_3": 1.0}))
    for bad in ({"transformer": float("nan")}, {"transformer": "1"}, {"transformer": True}, ["transformer"]):
        with pytest.raises(ArgumentError, match="component_strengths"):
            AdapterSpec(sd, component_strengths=bad)


def test_strict_ignores_expected_absent_but_not_other_misses():
    t2v = tiny_wan(False)
    sd = _lora(tiny_wan(True), WAN_KEYS)
    h = loraweave.apply(t2v, sd, strict=True)
    assert h.report.kinds() == {"expected_absent": 4}
    h.remove()
    sd["diffusion_model.blocks.7.self_attn.q.lora_down.weight"] = sd[
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight"
    ]
    sd["diffusion_model.blocks.7.self_attn.q.lora_up.weight"] = sd[
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight"
    ]
    with pytest.raises(StrictApplyError) as err:  # block 7 is in no Wan variant of 2 blocks: a real miss
        loraweave.apply(t2v, sd, strict=True)
    kinds = [u.kind for u in err.value.report.unmatched]
    assert kinds.count("expected_absent") == 4 and len(kinds) == 6


def test_same_keys_land_on_the_variant_that_has_them():
    i2v = tiny_wan(True)
    rep = loraweave.plan(i2v, _lora(i2v, WAN_KEYS))
    assert rep.unmatched == [] and rep.keys_applied == 8


def test_flux_guidance_keys_are_expected_absent_on_schnell():
    import diffusers

    cfg = dict(
        patch_size=1,
        in_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        pooled_projection_dim=8,
        axes_dims_rope=(2, 2, 4),
    )
    with torch.device("meta"):
        schnell = diffusers.FluxTransformer2DModel(**cfg, guidance_embeds=False)
        dev = diffusers.FluxTransformer2DModel(**cfg, guidance_embeds=True)
    sd = {}
    for stem, shape in (
        ("guidance_in.in_layer", (16, 256)),
        ("guidance_in.out_layer", (16, 16)),
        ("img_in", (16, 4)),
    ):
        sd[f"diffusion_model.{stem}.lora_A.weight"] = torch.empty(2, shape[1], device="meta")
        sd[f"diffusion_model.{stem}.lora_B.weight"] = torch.empty(shape[0], 2, device="meta")
    rep = loraweave.plan(schnell, sd)
    assert rep.kinds() == {"expected_absent": 4} and rep.ok
    assert "guidance" in rep.unmatched[0]["reason"]
    assert loraweave.plan(dev, sd).unmatched == []


def _bfl_lora(double: int, single: int, hidden: int) -> dict[str, torch.Tensor]:
    sd = {}
    for stem, n in (("double_blocks.{}.img_attn.qkv", double), ("single_blocks.{}.linear1", single)):
        for i in range(n):
            sd[f"diffusion_model.{stem.format(i)}.lora_A.weight"] = torch.empty(4, hidden, device="meta")
            sd[f"diffusion_model.{stem.format(i)}.lora_B.weight"] = torch.empty(3 * hidden, 4, device="meta")
    return sd


@pytest.mark.parametrize(
    "double, single, hidden, likely",
    [
        (8, 24, 4096, "flux2-klein-9b"),
        (5, 20, 3072, "flux2-klein-4b"),
        (8, 48, 6144, "flux2-dev"),
        (19, 38, 3072, "flux1 (dev, schnell, Fill, Kontext)"),
    ],
)
def test_block_counts_and_width_say_which_variant_fits(double, single, hidden, likely):
    from loraweave.arch.variants import variant_fit
    from loraweave.formats.adapter import load_adapter

    fit = variant_fit(load_adapter(_bfl_lora(double, single, hidden)))
    assert fit["blocks"] == {"double": double, "single": single} and fit["hidden"] == hidden
    assert fit["likely"] == likely
    partial = variant_fit(
        load_adapter(_bfl_lora(3, 10, 3072))
    )  # trains a few blocks: several variants can take it
    assert (
        partial["likely"] is None
        and "flux2-klein-4b" in partial["fits"]
        and "flux2-dev" not in partial["fits"]
    )


def test_inspect_names_the_variant(tmp_path):
    from safetensors.torch import save_file

    from loraweave.tools.inspect import format_table, inspect_adapter

    sd = {k: torch.zeros(v.shape) for k, v in _bfl_lora(8, 24, 64).items()}  # width 64: no released variant
    save_file(sd, tmp_path / "klein.safetensors")
    info = inspect_adapter(tmp_path / "klein.safetensors", arch="flux2")
    assert info["variant"]["blocks"] == {"double": 8, "single": 24} and info["variant"]["fits"] == []
    assert "no known variant (file: 8 double, 24 single blocks, width 64)" in format_table(info)


@pytest.mark.parametrize("style", ["diffusers", "kohya"])
def test_diffusers_single_blocks_are_not_counted_as_double(style):
    """`single_transformer_blocks` ends in the double chain's `transformer_blocks`: a diffusers or
    kohya-flattened Flux.1 file is 19 double + 38 single blocks, not 38 double (it was, before the single
    chain was tried first)."""
    from loraweave.arch.variants import block_counts, variant_fit
    from loraweave.formats.adapter import load_adapter

    sd = {}
    for stem, n in (("transformer_blocks.{}.attn.to_q", 19), ("single_transformer_blocks.{}.attn.to_q", 38)):
        for i in range(n):
            name = f"transformer.{stem.format(i)}"
            if style == "kohya":
                name = "lora_unet_" + stem.format(i).replace(".", "_")
            ab = ("lora_A", "lora_B") if style == "diffusers" else ("lora_down", "lora_up")
            sd[f"{name}.{ab[0]}.weight"] = torch.empty(4, 3072, device="meta")
            sd[f"{name}.{ab[1]}.weight"] = torch.empty(3072, 4, device="meta")
    assert block_counts(["single_transformer_blocks.37.attn.to_q"]) == {"single": 38}
    fit = variant_fit(load_adapter(sd))
    assert fit["blocks"] == {"double": 19, "single": 38}
    assert fit["likely"] == "flux1 (dev, schnell, Fill, Kontext)"
