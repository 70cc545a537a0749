"""ACE-Step 1.5 as an architecture (issue 41 item 2): diffusers' `AceStepTransformer1DModel` under its
original names.

Real key lists: ComfyUI #12638 (a LyCORIS LoKr + DoRA file from ACE-Step's own trainer, "lora key not loaded"
before ComfyUI PR #12665) quotes `lycoris_condition_embedder.{alpha,dora_scale,lokr_w1,lokr_w2_a,lokr_w2_b}`,
`lycoris_layers_0_cross_attn_k_proj.{alpha,dora_scale}` and `lycoris_time_embed_time_proj.lokr_w2_a`;
the official PEFT files are `base_model.model.layers.N.{self_attn,cross_attn}.{q,k,v,o}_proj.lora_A.weight`
(diffusers' `_convert_non_diffusers_ace_step_lora_to_diffusers`, ComfyUI PR #12252).

1. names: on the full-size meta model (diffusers' defaults, ACE-Step 1.5: 24 layers, hidden 2048, GQA) every
   original name lands on the module diffusers' converter sends it to, in each layout (PEFT, ComfyUI's
   `diffusion_model.decoder.`, LyCORIS), 100 %; detection names the architecture;
2. numbers: PEFT-format files equal diffusers' converter + PEFT, and LyCORIS LoKr + DoRA files equal
   LyCORIS's own wrapped forward (at multipliers 1 and 0.5), on every Linear of a tiny model, fp32, <= 1e-5
   rel.;
3. hostile: LoKr factors of a query projection on the narrower (GQA) key projection end in a typed error,
   the model unchanged; negative control: a swapped table row is caught by (1).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers.arch_layouts import assert_matches_peft, linears
from helpers.common import multiplier_outputs, outputs, rel_err
from helpers.registry import patch_tables

import loraweave
from loraweave.arch.aliases import AliasTable
from loraweave.arch.detect import detect_architecture

QUOTED_12638 = (
    "lycoris_condition_embedder.alpha",
    "lycoris_condition_embedder.dora_scale",
    "lycoris_condition_embedder.lokr_w1",
    "lycoris_condition_embedder.lokr_w2_a",
    "lycoris_condition_embedder.lokr_w2_b",
    "lycoris_layers_0_cross_attn_k_proj.alpha",
    "lycoris_layers_0_cross_attn_k_proj.dora_scale",
    "lycoris_time_embed_time_proj.lokr_w2_a",
    "lycoris_time_embed_time_proj.lokr_w2_b",
)
ACE_TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    in_channels=8,
    audio_acoustic_hidden_dim=4,
    patch_size=2,
    sliding_window=4,
)
# The test's own inverse of the converter: a live attention name -> the original one.
ORIGINAL = (("to_out.0", "o_proj"), ("to_q", "q_proj"), ("to_k", "k_proj"), ("to_v", "v_proj"))


def original(live: str) -> str:
    for new, old in ORIGINAL:
        live = live.replace(f"attn.{new}", f"attn.{old}")
    return live


def _ace(meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return diffusers.AceStepTransformer1DModel(**config)
    return diffusers.AceStepTransformer1DModel(**config).eval()


def _convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ace_step_lora_to_diffusers

    return _convert_non_diffusers_ace_step_lora_to_diffusers(dict(sd))


def lora_pairs(model, prefix: str, meta: bool = False, seed: int = 4) -> dict[str, torch.Tensor]:
    """A rank-2 LoRA on every Linear under its original name, `<prefix><name>.lora_A/B.weight`."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for live, m in linears(model).items():
        out, inp = m.weight.shape
        stem = prefix + original(live)
        if meta:
            sd[f"{stem}.lora_A.weight"] = torch.empty(2, inp, device="meta")
            sd[f"{stem}.lora_B.weight"] = torch.empty(out, 2, device="meta")
        else:
            sd[f"{stem}.lora_A.weight"] = torch.randn(2, inp, generator=g)
            sd[f"{stem}.lora_B.weight"] = torch.randn(out, 2, generator=g) * 0.1
    return sd


def lycoris_names(model, meta: bool = True) -> dict[str, torch.Tensor]:
    """LoKr + DoRA (LyCORIS's keys: alpha, dora_scale, lokr_w1, lokr_w2_a, lokr_w2_b) on every Linear, under
    `lycoris_<original name with _>`; LoKr factors 4 x (out/4, in/4) at rank 2, shapes only."""
    sd = {}
    for live, m in linears(model).items():
        out, inp = m.weight.shape
        stem = "lycoris_" + original(live).replace(".", "_")
        for role, shape in (
            ("alpha", ()),
            ("dora_scale", (out, 1)),
            ("lokr_w1", (4, 4)),
            ("lokr_w2_a", (out // 4, 2)),
            ("lokr_w2_b", (2, inp // 4)),
        ):
            sd[f"{stem}.{role}"] = torch.empty(shape, device="meta") if meta else torch.ones(shape)
    return sd


def converter_targets(sd: dict) -> dict[str, str]:
    """{original path: live module} as diffusers' converter maps the PEFT keys."""
    return {
        k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): c.removeprefix(
            "transformer."
        ).removesuffix(".lora_A.weight")
        for k in sd
        if k.endswith(".lora_A.weight")
        for c in _convert({k: sd[k]})
    }


def assert_lands_where_the_converter_says(model, sd: dict, targets: dict[str, str], spell=lambda p: p):
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd), report.unmatched[
        :3
    ]
    table = AliasTable(model)
    wrong = {
        path: (found, live)
        for path, live in targets.items()
        if not isinstance(found := table.lookup(spell(path)), tuple)
        or [(p.module, p.whole) for p in found] != [(live, True)]
    }
    assert not wrong, list(wrong.items())[:3]


@pytest.mark.parametrize("layout", ["peft", "comfyui", "lycoris"])
def test_ace_step_original_names_full_size(layout):
    model = _ace(True)
    peft = lora_pairs(model, "base_model.model.", meta=True)
    targets = converter_targets(peft)
    assert set(targets.values()) == set(linears(model))
    assert any(".cross_attn.k_proj" in p for p in targets) and "condition_embedder" in targets
    if layout == "peft":
        sd = peft
    elif layout == "comfyui":
        sd = lora_pairs(model, "diffusion_model.decoder.", meta=True)
    else:
        sd = lycoris_names(model)
        assert set(QUOTED_12638) <= set(sd), sorted(set(QUOTED_12638) - set(sd))
    spell = {"peft": str, "comfyui": lambda p: f"decoder.{p}", "lycoris": lambda p: p.replace(".", "_")}[
        layout
    ]
    assert_lands_where_the_converter_says(model, sd, targets, spell)
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == "ace-step"


def test_ace_step_peft_original_names_match_diffusers_and_peft():
    model = _ace(False, **ACE_TINY)
    sd = lora_pairs(model, "base_model.model.")
    assert_matches_peft(model, sd, _convert(sd))


def test_ace_step_lycoris_lokr_dora_matches_lycoris(tmp_path, lycoris_class_attrs):
    """LyCORIS's own LoKr + DoRA (weight decomposition) on every Linear of the diffusers model, its file's
    names written back to the originals (`_to_k` -> `_k_proj`) as ACE-Step's trainer names them; ours merged
    and at runtime against LyCORIS's wrapped forward at multipliers 1 and 0.5."""
    import lycoris
    from safetensors.torch import load_file, save_file

    pristine = _ace(False, **ACE_TINY)
    names = list(linears(pristine))
    g = torch.Generator().manual_seed(2)
    xs = {n: torch.randn(3, linears(pristine)[n].in_features, generator=g) for n in names}
    base = outputs(pristine, xs)
    wrapped = copy.deepcopy(pristine)
    lycoris_class_attrs.apply_preset({"target_module": ["Linear"], "target_name": [], "enable_conv": False})
    net = lycoris.create_lycoris(
        wrapped, 1.0, linear_dim=2, linear_alpha=1.0, algo="lokr", dora_wd=True, factor=4
    )
    net.apply_to()
    with torch.no_grad():  # zero-init factors and d = ‖W‖ would hide errors: perturb everything
        for m in net.loras:
            for name, p in m.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(p * (1 + 0.2 * noise) if name == "dora_scale" else noise * 0.3)
    refs = multiplier_outputs(net, wrapped, xs, (1.0, 0.5))
    net.save_weights(str(tmp_path / "live.safetensors"), dtype=torch.float32, metadata=None)
    saved = load_file(str(tmp_path / "live.safetensors"))
    sd = {}
    for k, v in saved.items():
        for new, old in ORIGINAL:
            k = k.replace(f"_attn_{new.replace('.', '_')}.", f"_attn_{old}.")
        sd[k] = v
    assert {"lycoris_layers_0_cross_attn_k_proj.dora_scale", "lycoris_condition_embedder.lokr_w2_b"} <= set(
        sd
    )
    path = tmp_path / "ace_lokr.safetensors"
    save_file(sd, str(path))
    for s, ref in refs.items():
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            report = loraweave.apply(model, (str(path), s), mode=mode, strict=True).report
            assert report.keys_applied == report.keys_total == len(sd)
            got = outputs(model, xs)
            assert min(rel_err(ref[n], base[n]) for n in names) > 1e-3
            worst = max(rel_err(got[n], ref[n]) for n in names)
            assert worst <= 1e-5, (mode, s, worst)


def test_ace_step_gqa_mismatch_is_a_typed_error(tmp_path):
    """LoKr factors sized for a query projection (4 heads) on the key projection (2 KV heads, half the rows):
    a shape mismatch naming the key, StrictApplyError under strict, nothing changed."""
    from safetensors.torch import save_file

    model = _ace(False, **ACE_TINY)
    q = model.layers[0].cross_attn.to_q
    assert q.out_features == 2 * model.layers[0].cross_attn.to_k.out_features
    stem = "lycoris_layers_0_cross_attn_k_proj"
    sd = {
        f"{stem}.lokr_w1": torch.ones(4, 4),
        f"{stem}.lokr_w2": torch.ones(q.out_features // 4, q.in_features // 4),
        f"{stem}.alpha": torch.tensor(1.0),
    }
    path = tmp_path / "gqa.safetensors"
    save_file(sd, str(path))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(loraweave.StrictApplyError, match="shape_mismatch") as err:
        loraweave.apply(model, str(path), mode="merge", strict=True)
    assert {u["key"] for u in err.value.report.unmatched} == set(sd)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ace_step_swapped_row_is_caught(monkeypatch):
    def swap(a):
        if a.source == "layers.{i}.cross_attn.k_proj":
            return dataclasses.replace(a, targets=("layers.{i}.cross_attn.to_v",))
        return a

    patch_tables(
        monkeypatch,
        lambda t: dataclasses.replace(t, aliases=tuple(map(swap, t.aliases))) if t.name == "ace-step" else t,
    )
    model = _ace(True)
    sd = lycoris_names(model)
    targets = converter_targets(lora_pairs(model, "base_model.model.", meta=True))
    with pytest.raises(AssertionError):
        assert_lands_where_the_converter_says(model, sd, targets, lambda p: p.replace(".", "_"))
