"""Block slots on full-size meta models (SD1.5, SDXL, Flux, Z-Image) and block-weight values/presets."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from loraweave.arch.blocks import (
    LBW_PRESETS_17,
    block_slots,
    block_weights,
    chain_lengths,
    detect_block_arch,
    slot_names,
    unet_layout,
)


def _meta_model(realdata, cls_name: str, config_file: str):
    import diffusers

    cfg = json.loads((realdata / "configs" / config_file).read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
    with torch.device("meta"):
        return getattr(diffusers, cls_name).from_config(cfg)


def _weight_paths(model) -> list[str]:
    # the layers an adapter can target: every Linear / Conv2d
    return [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


@pytest.fixture(scope="module")
def sd15(realdata):
    return _meta_model(realdata, "UNet2DConditionModel", "sd15__unet_config.json")


@pytest.fixture(scope="module")
def sdxl(realdata):
    return _meta_model(realdata, "UNet2DConditionModel", "sdxl-base__unet_config.json")


def _attn(n_transformer_blocks: int) -> int:
    # proj_in + proj_out + per block: attn1 q,k,v,out + attn2 q,k,v,out + ff in/out
    return 2 + 10 * n_transformer_blocks


RES, RES_SC = 3, 4  # conv1, conv2, time_emb_proj (+ conv_shortcut when channels change)


def test_sd15_module_to_slot_counts(sd15):
    assert detect_block_arch(sd15) == "sd1"
    paths = _weight_paths(sd15)
    slots = block_slots("sd1", paths)
    counts = Counter(slots.values())
    a = _attn(1)
    expected = {
        "BASE": 3,  # time_embedding.linear_1/2, conv_out
        "IN00": 1,  # conv_in
        "IN01": RES + a,
        "IN02": RES + a,
        "IN03": 1,
        "IN04": RES_SC + a,
        "IN05": RES + a,
        "IN06": 1,
        "IN07": RES_SC + a,
        "IN08": RES + a,
        "IN09": 1,
        "IN10": RES,
        "IN11": RES,
        "M00": 2 * RES + a,
        "OUT00": RES_SC,
        "OUT01": RES_SC,
        "OUT02": RES_SC + 1,
        "OUT03": RES_SC + a,
        "OUT04": RES_SC + a,
        "OUT05": RES_SC + a + 1,
        "OUT06": RES_SC + a,
        "OUT07": RES_SC + a,
        "OUT08": RES_SC + a + 1,
        "OUT09": RES_SC + a,
        "OUT10": RES_SC + a,
        "OUT11": RES_SC + a,
    }
    assert dict(counts) == expected
    assert sum(expected.values()) == len(paths) == 282
    assert list(expected) == slot_names("sd1")
    # spot checks of the original-SD order
    assert slots["down_blocks.1.attentions.1.transformer_blocks.0.attn2.to_k"] == "IN05"
    assert slots["down_blocks.2.downsamplers.0.conv"] == "IN09"
    assert slots["up_blocks.1.upsamplers.0.conv"] == "OUT05"
    assert slots["up_blocks.3.attentions.2.proj_out"] == "OUT11"
    assert slots["mid_block.resnets.1.conv2"] == "M00"


def test_sdxl_module_to_slot_counts(sdxl):
    assert detect_block_arch(sdxl) == "sdxl"
    paths = _weight_paths(sdxl)
    counts = Counter(block_slots("sdxl", paths).values())
    a2, a10 = _attn(2), _attn(10)
    expected = {
        "BASE": 5,  # time_embedding ×2, add_embedding ×2, conv_out
        "IN00": 1,
        "IN01": RES,
        "IN02": RES,
        "IN03": 1,
        "IN04": RES_SC + a2,
        "IN05": RES + a2,
        "IN06": 1,
        "IN07": RES_SC + a10,
        "IN08": RES + a10,
        "M00": 2 * RES + a10,
        "OUT00": RES_SC + a10,
        "OUT01": RES_SC + a10,
        "OUT02": RES_SC + a10 + 1,
        "OUT03": RES_SC + a2,
        "OUT04": RES_SC + a2,
        "OUT05": RES_SC + a2 + 1,
        "OUT06": RES_SC,
        "OUT07": RES_SC,
        "OUT08": RES_SC,
    }
    assert dict(counts) == expected
    assert sum(expected.values()) == len(paths) == 794
    assert list(expected) == slot_names("sdxl")


def test_flux_module_to_slot_counts(realdata):
    model = _meta_model(realdata, "FluxTransformer2DModel", "flux1-dev__transformer_config.json")
    assert detect_block_arch(model) == "flux"
    paths = _weight_paths(model)
    assert chain_lengths("flux", paths) == {"transformer_blocks": 19, "single_transformer_blocks": 38}
    slots = block_slots("flux", paths)
    counts = Counter(slots.values())
    # double block: img/txt q,k,v + add_q/k/v (6) + to_out + to_add_out (2) + norm1/norm1_context linear (2)
    # + ff/ff_context in/out (4) = 14; single block: q,k,v, norm.linear, proj_mlp, proj_out = 6
    assert {s: c for s, c in counts.items() if s.startswith("D")} == {f"D{i:02d}": 14 for i in range(19)}
    assert {s: c for s, c in counts.items() if s.startswith("S")} == {f"S{i:02d}": 6 for i in range(38)}
    # time/guidance/text embedders (6), context_embedder, x_embedder, norm_out.linear, proj_out
    assert counts["BASE"] == 10
    assert slots["single_transformer_blocks.37.proj_out"] == "S37"
    assert (
        block_slots("flux", ["transformer.transformer_blocks.3.attn.to_q"])[
            "transformer.transformer_blocks.3.attn.to_q"
        ]
        == "D03"
    )


def test_zimage_module_to_slot_counts(realdata):
    model = _meta_model(realdata, "ZImageTransformer2DModel", "z-image-turbo__transformer_config.json")
    assert detect_block_arch(model) == "zimage"
    paths = _weight_paths(model)
    counts = Counter(block_slots("zimage", paths).values())
    # layer: to_q/k/v/out (4) + w1/w2/w3 (3) + adaLN modulation (1) = 8
    assert {s: c for s, c in counts.items() if s != "BASE"} == {f"J{i:02d}": 8 for i in range(30)}
    # refiners (2 noise ×8, 2 context ×7) + t_embedder ×2 + cap_embedder + x_embedder + final layer ×2
    assert counts["BASE"] == 16 + 14 + 2 + 1 + 1 + 2


def test_text_encoder_paths_are_left_to_the_caller():
    slots = block_slots("sd1", ["text_encoder.text_model.encoder.layers.0.mlp.fc1", "unet.conv_in"])
    assert slots == {"text_encoder.text_model.encoder.layers.0.mlp.fc1": None, "unet.conv_in": "IN00"}


# --- values ---------------------------------------------------------------------------------------------


def test_unet_presets_restricted_to_17_equal_published_lbw_vectors():
    short = unet_layout("sd1")
    for name, vector in LBW_PRESETS_17.items():
        got = block_weights("sd1", name)
        assert len(got) == 26
        assert tuple(got[s] for s in short) == tuple(float(v) for v in vector), name


def test_sd1_preset_on_full_layout_groups():
    w = block_weights("sd1", "OUTS")
    on = {s for s, v in w.items() if v == 1.0}
    assert on == {"BASE", "OUT07", "OUT08", "OUT09", "OUT10", "OUT11"}
    w = block_weights("sd1", "ind")  # case-insensitive
    assert {s for s, v in w.items() if v} == {"BASE", "IN05", "IN06", "IN07", "IN08", "IN09", "IN10", "IN11"}


def test_sdxl_presets():
    w = block_weights("sdxl", "MIDD")
    assert {s for s, v in w.items() if v} == {"BASE", "IN07", "IN08", "M00", "OUT00", "OUT01", "OUT02"}
    w = block_weights("sdxl", "INS")
    assert {s for s, v in w.items() if v} == {"BASE", *(f"IN{i:02d}" for i in range(7))}
    assert set(block_weights("sdxl", "ALL0.5").values()) == {0.5}


def test_sd15_preset_selects_modules(sd15):
    paths = _weight_paths(sd15)
    slots = block_slots("sd1", paths)
    w = block_weights("sd1", "OUTS")
    active = [p for p in paths if w[slots[p]] == 1.0]
    # BASE 3 + OUT07 16 + OUT08 17 + OUT09..11 16 each
    assert len(active) == 3 + 16 + 17 + 3 * 16
    assert all(p.startswith(("up_blocks.2", "up_blocks.3", "time_embedding", "conv_out")) for p in active)
    assert not any(
        p.startswith("up_blocks.2.resnets.0") or p.startswith("up_blocks.2.attentions.0") for p in active
    )


def test_vectors_scalar_dict_and_text():
    vec17 = [0.1 * i for i in range(17)]
    w = block_weights("sd1", vec17)
    assert w["IN01"] == pytest.approx(0.1) and w["OUT11"] == pytest.approx(1.6)
    assert w["IN00"] == w["IN03"] == w["OUT00"] == 1.0  # LBW fills the slots the 17 layout lacks with 1
    w12 = block_weights("sdxl", list(range(12)))
    assert (w12["BASE"], w12["IN04"], w12["M00"], w12["OUT05"], w12["OUT06"]) == (0, 1, 5, 11, 1.0)
    full = block_weights("sd1", list(range(26)))
    assert list(full.values()) == [float(i) for i in range(26)]
    no_base = block_weights("sdxl", torch.arange(19, dtype=torch.float32))
    assert no_base["BASE"] == 1.0 and no_base["OUT08"] == 18.0
    assert set(block_weights("flux", 0.7).values()) == {0.7}
    d = block_weights("flux", {"D00": 0.0, "S37": 2.0})
    assert d["D00"] == 0.0 and d["S37"] == 2.0 and d["D01"] == 1.0 and len(d) == 58
    assert block_weights("sd1", "1," + ",".join(["0"] * 16))["IN01"] == 0.0


def test_dit_presets_stretch_to_block_count():
    w = block_weights("flux", "OUTS")  # 57 blocks; OUTS keeps the last 5/16 of the 17-slot block entries
    blocks = slot_names("flux")[1:]
    expected_on = {b for k, b in enumerate(blocks) if (k * 16) // 57 >= 11}
    assert {s for s, v in w.items() if v and s != "BASE"} == expected_on
    assert len(expected_on) == 57 - (11 * 57 + 15) // 16  # first k with floor(16k/57) >= 11 is ceil(11·57/16)
    z = block_weights("zimage", "INALL")
    assert {s for s, v in z.items() if v} == {
        "BASE",
        *(f"J{i:02d}" for i in range(12)),
    }  # 6 IN entries of 16: 16k//30 < 6
    dbl = block_weights("chroma", "DOUBLE")
    assert {s for s, v in dbl.items() if v} == {"BASE", *(f"D{i:02d}" for i in range(19))}
    # a smaller model: chains from its paths
    w8 = block_weights("zimage", "ALL", chains={"layers": 8})
    assert list(w8) == ["BASE", *(f"J{i:02d}" for i in range(8))]
    assert len(block_weights("sd3", "NONE", n_slots=25)) == 25


@pytest.mark.parametrize(
    "arch,value,match",
    [
        ("sd1", [1.0] * 13, r"13 values fit no layout.*26 values.*25.*17-value"),
        ("sdxl", [1.0] * 17, r"17 values fit no layout.*12-value"),
        ("flux", "FANCY", r"not a preset.*DOUBLE"),
        ("zimage", "DOUBLE", "no"),
        ("flux", {"IN04": 1.0}, "unknown slots"),
        ("sd1", [1.0, float("nan")] + [1.0] * 24, "finite"),
        ("sd1", True, "cannot use bool"),
        ("unet9", 1.0, "unknown block arch"),
        ("sd1", 1.0, None),
    ],
)
def test_values_that_fit_nothing_raise(arch, value, match):
    if match is None:  # n_slots disagreeing with the layout
        with pytest.raises(ValueError, match="n_slots"):
            block_weights(arch, value, n_slots=17)
        return
    with pytest.raises(ValueError, match=match):
        block_weights(arch, value)


def test_detect_rejects_unknown_models():
    with pytest.raises(ValueError, match="no block-slot table"):
        detect_block_arch(torch.nn.Linear(2, 2))


def test_weights_for_modules_uses_model_chains():
    from loraweave.arch.blocks import weights_for_modules

    # an adapter touching only the first 10 single blocks of Flux: the preset still stretches over all 57
    paths = [f"single_transformer_blocks.{i}.proj_out" for i in range(10)] + [
        "transformer_blocks.18.attn.to_q",
        "text_encoder.x.fc1",
    ]
    model_chains = {"transformer_blocks": 19, "single_transformer_blocks": 38}
    w = weights_for_modules("flux", paths, "OUTD", chains=model_chains)
    full = block_weights("flux", "OUTD", chains=model_chains)
    assert w["text_encoder.x.fc1"] is None
    assert all(w[p] == full[f"S{int(p.split('.')[1]):02d}"] for p in paths[:10])
    assert w["transformer_blocks.18.attn.to_q"] == full["D18"]
    with pytest.raises(ValueError, match="beyond"):
        weights_for_modules(
            "flux", paths, 1.0, chains={"transformer_blocks": 5, "single_transformer_blocks": 38}
        )
