"""New layouts and original-name tables, each against diffusers' own converter (+ PEFT for the numbers).

Per layout/architecture:
1. the converter is the oracle for names: every original name of a converter-derived key list must land on the
   module the converter maps it to (on the full-size meta model: 100 %, nothing else);
2. merged and runtime outputs of every Linear equal diffusers' converter + PEFT (`load_lora_adapter`) on a
   tiny model of the class (fp32, 1e-5 relative);
3. negative controls: a swapped table row makes (1) fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.arch_layouts import assert_matches_peft, linears, lora_file, ltx2_original, lumina2_lora_names
from helpers.registry import patch_tables
from helpers.tiny_configs import LTX2_FULL, LTX2_TINY
from helpers.tiny_models import tiny_flux

import loraweave
from loraweave.arch.aliases import AliasTable


def converter_targets(convert, sd: dict, prefix: str = "transformer.") -> dict[str, str]:
    """{file stem: live module} as diffusers' converter maps them (one key at a time)."""
    out = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            (converted,) = convert({key: sd[key]})
            out[key.removesuffix(".lora_A.weight")] = converted.removeprefix(prefix).removesuffix(
                ".lora_A.weight"
            )
    return out


def assert_lands_where_the_converter_says(model, sd: dict, targets: dict[str, str]):
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    table = AliasTable(model)
    wrong = {
        stem: (found, live)
        for stem, live in targets.items()
        if (found := [p.module for p in table.lookup(stem.split(".", 1)[1])]) != [live]
    }
    assert not wrong, list(wrong.items())[:3]


def _ltx2(meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return diffusers.LTX2VideoTransformer3DModel(**config)
    return diffusers.LTX2VideoTransformer3DModel(**config).eval()


def _ltx2_convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    return _convert_non_diffusers_ltx2_lora_to_diffusers(dict(sd))


def test_ltx2_original_names_full_size():
    """Audio tower, audio<->video cross-attention, adaln_single, prompt modulation and gate logits (LTX-2.3
    config)."""
    model = _ltx2(True, **LTX2_FULL)
    modules = linears(model)
    sd = lora_file(modules, lambda n: f"diffusion_model.{ltx2_original(n)}", meta=True)
    assert any("audio_adaln_single" in k for k in sd) and any("to_gate_logits" in k for k in sd)
    assert any("av_ca_a2v_gate_adaln_single" in k for k in sd) and any("prompt_adaln_single" in k for k in sd)
    targets = converter_targets(_ltx2_convert, sd)
    assert set(targets.values()) == set(modules)
    assert_lands_where_the_converter_says(model, sd, targets)


def test_ltx2_original_names_match_diffusers_and_peft():
    model = _ltx2(False, **LTX2_TINY)
    sd = lora_file(linears(model), lambda n: f"diffusion_model.{ltx2_original(n)}")
    assert_matches_peft(model, sd, _ltx2_convert(sd))


def test_ltx2_swapped_rename_row_is_caught(monkeypatch):
    def swap(t):
        r = list(t.renames)
        i, j = (
            r.index(("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate")),
            r.index(("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate")),
        )
        r[i], r[j] = (r[i][0], r[j][1]), (r[j][0], r[i][1])
        return dataclasses.replace(t, renames=tuple(r))

    patch_tables(monkeypatch, lambda t: swap(t) if t.name == "ltx2" else t)
    model = _ltx2(True, **LTX2_FULL)
    sd = lora_file(linears(model), lambda n: f"diffusion_model.{ltx2_original(n)}", meta=True)
    with pytest.raises(AssertionError):
        assert_lands_where_the_converter_says(model, sd, converter_targets(_ltx2_convert, sd))


def test_ltx2_connectors_original_prefix():
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    with torch.device("meta"):
        connectors = LTX2TextConnectors()
    modules = {n: m for n, m in linears(connectors).items()}
    sd = lora_file(
        modules,
        lambda n: f"text_embedding_projection.{n.replace('text_proj_in', 'aggregate_embed')}",
        meta=True,
    )
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers as convert,
    )

    targets = converter_targets(
        lambda s: convert(dict(s), "text_embedding_projection"), sd, prefix="connectors."
    )
    assert set(targets.values()) == set(modules)
    report = loraweave.plan({"transformer": _ltx2(True, num_layers=1), "connectors": connectors}, sd)
    assert report.unmatched == [] and {m.component for m in report.applied} == {"connectors"}


FLUX_BFL = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": ("attn.to_out.0",),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": ("attn.to_add_out",),
}


def xlabs_file(model, seed: int = 5) -> dict[str, torch.Tensor]:
    """XLabs' processor LoRA: per double block qkv/proj for lora1 and lora2, per single block qkv."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    sd = {}
    for i in range(len(model.transformer_blocks)):
        for name, n in (
            ("qkv_lora1", "to_q"),
            ("qkv_lora2", "add_q_proj"),
            ("proj_lora1", "to_out.0"),
            ("proj_lora2", "to_add_out"),
        ):
            m = mods[f"transformer_blocks.{i}.attn.{n}"]
            rows = 3 * m.out_features if name.startswith("qkv") else m.out_features
            sd[f"double_blocks.{i}.processor.{name}.down.weight"] = torch.randn(2, m.in_features, generator=g)
            sd[f"double_blocks.{i}.processor.{name}.up.weight"] = torch.randn(rows, 2, generator=g) * 0.1
    for i in range(len(model.single_transformer_blocks)):
        m = mods[f"single_transformer_blocks.{i}.attn.to_q"]
        sd[f"single_blocks.{i}.processor.qkv_lora.down.weight"] = torch.randn(2, m.in_features, generator=g)
        sd[f"single_blocks.{i}.processor.qkv_lora.up.weight"] = (
            torch.randn(3 * m.out_features, 2, generator=g) * 0.1
        )
    return sd


def test_xlabs_flux_matches_diffusers_and_peft():
    from diffusers.loaders.lora_conversion_utils import _convert_xlabs_flux_lora_to_diffusers

    model = tiny_flux()
    sd = xlabs_file(model)
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.adapters[0]["layout"] == "xlabs"
    assert_matches_peft(model, sd, _convert_xlabs_flux_lora_to_diffusers(dict(sd)))
    with_prefix = {f"diffusion_model.{k}": v for k, v in sd.items()}
    assert loraweave.plan(model, with_prefix).keys_applied == len(sd)


def test_xlabs_lora1_is_the_image_stream():
    """Negative control: lora1 on the text stream (swapped) gives other outputs than diffusers' converter."""
    from diffusers.loaders.lora_conversion_utils import _convert_xlabs_flux_lora_to_diffusers

    model = tiny_flux()
    sd = xlabs_file(model)
    swapped = {
        k.replace("lora1", "lora#").replace("lora2", "lora1").replace("lora#", "lora2"): v
        for k, v in sd.items()
    }
    with pytest.raises(AssertionError):
        assert_matches_peft(model, swapped, _convert_xlabs_flux_lora_to_diffusers(dict(sd)))


def bfl_flux_file(model, prefix: str, seed: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mods = dict(model.named_modules())
    sd = {}
    for i in range(len(model.transformer_blocks)):
        for bfl, parts in FLUX_BFL.items():
            m = mods[f"transformer_blocks.{i}.{parts[0]}"]
            sd[f"{prefix}double_blocks.{i}.{bfl}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g)
            sd[f"{prefix}double_blocks.{i}.{bfl}.lora_B.weight"] = (
                torch.randn(len(parts) * m.out_features, 2, generator=g) * 0.1
            )
        for bfl, live in (
            ("img_mod.lin", "norm1.linear"),
            ("txt_mod.lin", "norm1_context.linear"),
            ("img_mlp.0", "ff.net.0.proj"),
            ("img_mlp.2", "ff.net.2"),
            ("txt_mlp.0", "ff_context.net.0.proj"),
            ("txt_mlp.2", "ff_context.net.2"),
        ):
            m = mods[f"transformer_blocks.{i}.{live}"]
            sd[f"{prefix}double_blocks.{i}.{bfl}.lora_A.weight"] = torch.randn(2, m.in_features, generator=g)
            sd[f"{prefix}double_blocks.{i}.{bfl}.lora_B.weight"] = (
                torch.randn(m.out_features, 2, generator=g) * 0.1
            )
    for i in range(len(model.single_transformer_blocks)):
        b = f"single_transformer_blocks.{i}"
        h, mlp = mods[f"{b}.attn.to_q"].out_features, mods[f"{b}.proj_mlp"].out_features
        for bfl, rows, inp in (
            ("linear1", 3 * h + mlp, h),
            ("linear2", h, mods[f"{b}.proj_out"].in_features),
            ("modulation.lin", 3 * h, h),
        ):
            sd[f"{prefix}single_blocks.{i}.{bfl}.lora_A.weight"] = torch.randn(2, inp, generator=g)
            sd[f"{prefix}single_blocks.{i}.{bfl}.lora_B.weight"] = torch.randn(rows, 2, generator=g) * 0.1
    sd[f"{prefix}final_layer.linear.lora_A.weight"] = torch.randn(2, model.proj_out.in_features, generator=g)
    sd[f"{prefix}final_layer.linear.lora_B.weight"] = (
        torch.randn(model.proj_out.out_features, 2, generator=g) * 0.1
    )
    return sd


def test_fal_kontext_matches_diffusers_and_peft(monkeypatch):
    """fal's Kontext trainer: `base_model.model.` + BFL names. diffusers' converter hard-codes 19/38 blocks of
    width 3072, so the tiny model is checked through it with the block counts and widths it expects patched
    out."""
    from diffusers.loaders import lora_conversion_utils as lcu

    model = tiny_flux()
    sd = bfl_flux_file(model, "base_model.model.")
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == len(sd)
    converted = _fal_convert(lcu, model, sd)
    assert_matches_peft(model, sd, converted)


def _fal_convert(lcu, model, sd):
    """Run diffusers' fal Kontext converter on a tiny Flux: its constants (19, 38, 3072) are the only
    change."""
    import inspect

    source = inspect.getsource(lcu._convert_fal_kontext_lora_to_diffusers)
    h = model.config.num_attention_heads * model.config.attention_head_dim
    for old, new in (
        ("num_layers = 19", len(model.transformer_blocks)),
        ("inner_dim = 3072", h),
        ("num_single_layers = 38", len(model.single_transformer_blocks)),
    ):
        assert old in source
        source = source.replace(old, f"{old.split(' = ')[0]} = {new}")
    namespace = dict(vars(lcu))
    exec(source, namespace)  # noqa: S102 - the library's own function with the tiny model's sizes
    return namespace["_convert_fal_kontext_lora_to_diffusers"](dict(sd))


@pytest.mark.parametrize("form", ["default", "default_0", "comfy"])
def test_peft_adapter_names(form):
    """DiffSynth / PEFT adapter names (`lora_A.default.weight`, `lora_A.default_0.weight`) and ComfyUI's
    `<module>.weight.lora_B.default.weight` land where the plain PEFT names land, with the same numbers."""
    model = tiny_flux()
    plain = lora_file(linears(model), lambda n: f"transformer.{n}")
    if form == "comfy":
        sd = {
            k.replace(".lora_A.weight", ".weight.lora_A.default.weight").replace(
                ".lora_B.weight", ".weight.lora_B.default.weight"
            ): v
            for k, v in plain.items()
        }
    else:
        sd = {k.replace(".weight", f".{form}.weight"): v for k, v in plain.items()}
    assert_matches_peft(model, sd, plain)


WAN_ORIGINAL = {
    "attn1": "self_attn",
    "attn2": "cross_attn",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "o",
    "ffn.net.0.proj": "ffn.0",
    "ffn.net.2": "ffn.2",
}


def wan_original(live: str) -> str:
    for new, old in WAN_ORIGINAL.items():
        live = live.replace(new, old)
    return live


def _wan_block_linears(model):
    return {n: m for n, m in linears(model).items() if n.startswith("blocks.")}


def test_musubi_wan_matches_diffusers_and_peft():
    """musubi-tuner: kohya-flattened Wan names with alpha (here alpha/rank = 0.5, which the converter
    folds)."""
    from diffusers.loaders.lora_conversion_utils import _convert_musubi_wan_lora_to_diffusers
    from helpers.tiny_configs import tiny_wan

    model = tiny_wan(False)
    sd = {}
    for k, v in lora_file(
        _wan_block_linears(model), lambda n: "lora_unet_" + wan_original(n).replace(".", "_")
    ).items():
        sd[k.replace("lora_A", "lora_down").replace("lora_B", "lora_up")] = v
        sd[k.split(".lora_")[0] + ".alpha"] = torch.tensor(1.0)
    assert_matches_peft(model, sd, _convert_musubi_wan_lora_to_diffusers(dict(sd)))


def test_diffusion_pipe_wan_matches_diffusers_and_peft():
    """diffusion-pipe saves Wan LoRAs in ComfyUI form: `diffusion_model.<Wan name>.lora_A.weight`, no
    alpha."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers
    from helpers.tiny_configs import tiny_wan

    model = tiny_wan(True)
    sd = lora_file(
        _wan_block_linears(model),
        lambda n: (
            "diffusion_model." + wan_original(n).replace("add_k_proj", "k_img").replace("add_v_proj", "v_img")
        ),
    )
    assert any(".k_img." in k for k in sd)
    assert_matches_peft(model, sd, _convert_non_diffusers_wan_lora_to_diffusers(dict(sd)))


def test_stand_in_is_parsed_resolved_and_refused_with_its_reason():
    from helpers.tiny_configs import tiny_wan

    model = tiny_wan(False)
    sd = {
        f"{p}blocks.0.self_attn.{x}_loras.{r}.weight": torch.zeros(
            2 if r == "down" else 32, 32 if r == "down" else 2
        )
        for p in ("", "diffusion_model.")
        for x in "qkv"
        for r in ("down", "up")
    }
    report = loraweave.plan(model, sd)
    assert report.keys_applied == 0 and len(report.unmatched) == len(sd)
    assert all(
        u["reason"].startswith("unsupported family: standin (Stand-In LoRAs act only on the reference-image")
        and "blocks.0.attn1.to_" in u["reason"]
        for u in report.unmatched
    )


def _lora_from_shapes(shapes: dict, prefix: str, meta: bool, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for stem, (rows, inp) in shapes.items():
        a = torch.empty(2, inp, device="meta") if meta else torch.randn(2, inp, generator=g)
        b = torch.empty(rows, 2, device="meta") if meta else torch.randn(rows, 2, generator=g) * 0.1
        sd[f"{prefix}{stem}.lora_A.weight"], sd[f"{prefix}{stem}.lora_B.weight"] = a, b
    return sd


def _lumina2_lora_converter(q: int, kv: int):
    import inspect

    from diffusers.loaders import lora_conversion_utils as lcu

    source = inspect.getsource(lcu._convert_non_diffusers_lumina2_lora_to_diffusers)
    assert "[2304, 768, 768]" in source
    namespace = dict(vars(lcu))
    exec(source.replace("[2304, 768, 768]", f"[{q}, {kv}, {kv}]"), namespace)  # noqa: S102 - only the widths change
    return namespace["_convert_non_diffusers_lumina2_lora_to_diffusers"]


def test_lumina2_full_size_lands_where_the_converter_says():
    import diffusers
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lumina2_lora_to_diffusers as convert,
    )

    with torch.device("meta"):
        model = diffusers.Lumina2Transformer2DModel()
    sd = _lora_from_shapes(lumina2_lora_names(model), "diffusion_model.", meta=True)
    converted = convert(dict(sd))  # raises on anything it does not consume
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] for k in converted} == {
        n for n, m in model.named_modules() if type(m) is torch.nn.Linear
    } - {
        "x_embedder",
        "norm_out.linear_1",
        "norm_out.linear_2",
        "time_caption_embed.caption_embedder.1",
        "time_caption_embed.timestep_embedder.linear_1",
        "time_caption_embed.timestep_embedder.linear_2",
    }
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == len(sd)


def test_lumina2_matches_diffusers_and_peft():
    from helpers.tiny_configs import tiny_lumina2

    model = tiny_lumina2().eval()
    sd = _lora_from_shapes(lumina2_lora_names(model), "diffusion_model.", meta=False)
    assert_matches_peft(model, sd, _lumina2_lora_converter(64, 32)(dict(sd)))


@pytest.mark.parametrize(
    "cls, config",
    [
        # HiDream-I1 config; MoE experts and the shared expert are plain modules.
        (
            "HiDreamImageTransformer2DModel",
            dict(
                patch_size=2,
                in_channels=16,
                out_channels=16,
                caption_channels=[4096, 4096],
                axes_dims_rope=(64, 32, 32),
                llama_layers=list(range(48)),
            ),
        ),
        ("LTXVideoTransformer3DModel", {}),
    ],
)
def test_prefix_only_layouts_full_size(cls, config):
    """HiDream and LTX-Video LoRAs use the diffusers module names behind `diffusion_model.` (the converters
    only swap that prefix for `transformer.`): every Linear of the full-size model resolves."""
    import diffusers
    from diffusers.loaders import lora_conversion_utils as lcu

    convert = {
        "HiDreamImageTransformer2DModel": lcu._convert_non_diffusers_hidream_lora_to_diffusers,
        "LTXVideoTransformer3DModel": lcu._convert_non_diffusers_ltxv_lora_to_diffusers,
    }[cls]
    with torch.device("meta"):
        model = getattr(diffusers, cls)(**config)
    modules = linears(model)
    sd = lora_file(modules, lambda n: f"diffusion_model.{n}", meta=True)
    targets = converter_targets(lambda s: convert(dict(s)), sd)
    assert set(targets.values()) == set(modules)
    if cls.startswith("HiDream"):
        assert any(".experts." in n for n in modules) and any("shared_experts" in n for n in modules)
    assert_lands_where_the_converter_says(model, sd, targets)


def flux3_original(live: str) -> str:
    """A live Flux3 name as BFL writes it (the test's inverse of the converter's renames)."""
    if live.startswith("mode_blocks."):
        live = "content_" + live
    live = live.replace("single_transformer_blocks.", "single_blocks.")
    for new, old in (
        (".attn.to_q", ".q_proj"),
        (".attn.to_k", ".k_proj"),
        (".attn.to_v", ".v_proj"),
        (".attn.to_out.0", ".attn_out"),
        (".ff.linear_in", ".mlp_in"),
        (".ff.linear_out", ".mlp_out"),
    ):
        live = live.replace(new, old)
    return live


def _flux3_convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_flux3_lora_to_diffusers

    return _convert_non_diffusers_flux3_lora_to_diffusers(dict(sd))


def test_flux3_original_names_full_size():
    import diffusers

    with torch.device("meta"):
        model = diffusers.Flux3Transformer2DModel()
    modules = linears(model)
    sd = lora_file(modules, lambda n: f"diffusion_model.{flux3_original(n)}", meta=True)
    assert any("content_mode_blocks" in k for k in sd) and any(".mlp_in." in k for k in sd)
    targets = converter_targets(_flux3_convert, sd)
    assert set(targets.values()) == set(modules)
    assert_lands_where_the_converter_says(model, sd, targets)
    kohya = {
        "lora_unet_"
        + k.split(".", 1)[1].rsplit(".lora_", 1)[0].replace(".", "_")
        + ".lora_"
        + k.rsplit(".lora_", 1)[1]: v
        for k, v in sd.items()
    }
    assert loraweave.plan(model, kohya).unmatched == []


def test_flux3_swapped_rename_row_is_caught(monkeypatch):
    def swap(t):
        r = [
            (".q_proj.", ".attn.to_k.")
            if o == ".q_proj."
            else (".k_proj.", ".attn.to_q.")
            if o == ".k_proj."
            else (o, n)
            for o, n in t.renames
        ]
        return dataclasses.replace(t, renames=tuple(r))

    patch_tables(monkeypatch, lambda t: swap(t) if t.name == "flux3" else t)
    import diffusers

    with torch.device("meta"):
        model = diffusers.Flux3Transformer2DModel(num_layers=1, num_single_layers=1)
    sd = lora_file(linears(model), lambda n: f"diffusion_model.{flux3_original(n)}", meta=True)
    with pytest.raises(AssertionError):
        assert_lands_where_the_converter_says(model, sd, converter_targets(_flux3_convert, sd))


def test_flux3_matches_diffusers_and_peft():
    import diffusers

    torch.manual_seed(0)
    model = diffusers.Flux3Transformer2DModel(
        in_channels=8,
        cond_in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        timestep_channels=16,
        axes_dims_rope=(2, 2, 2, 2),
    ).eval()
    sd = lora_file(linears(model), lambda n: f"diffusion_model.{flux3_original(n)}")
    assert_matches_peft(model, sd, _flux3_convert(sd))
