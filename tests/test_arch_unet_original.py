"""Original (ldm/sgm) <-> diffusers UNet module map, checked against real key lists and shapes."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REALDATA, SHARED
from diffusers import UNet2DConditionModel

from loraweave.arch.unet_original import unet_original_names

UNET_PREFIX = "model.diffusion_model."

# Real config; sd-mecha original checkpoint key list; sd-mecha key list in diffusers naming
# and the prefix of its UNet keys.
MODELS = {
    "sd1": ("sd15__unet_config.json", "sd1-ldm.yaml", ("sd1-kohya.yaml", "unet.")),
    "sdxl": ("sdxl-base__unet_config.json", "sdxl-sgm.yaml", ("sdxl-diffusers_unet_only.yaml", "")),
}
# Diffusers modules with parameters that have no original counterpart.  None today: any
# exception must be listed here by name rather than skipped.
EXPECTED_UNMAPPED: dict[str, set[str]] = {"sd1": set(), "sdxl": set(), "sdxl-refiner": set()}


def _real(relative: str) -> Path:
    path = REALDATA / relative
    assert path.exists(), f"real data missing: {path} (expected the shared checkout at {SHARED})"
    return path


@functools.cache
def _unet(config_file: str, **overrides: object) -> UNet2DConditionModel:
    config = json.loads(_real(f"configs/{config_file}").read_text()) | overrides
    with torch.device("meta"):
        return UNet2DConditionModel.from_config(config)


@functools.cache
def _yaml_keys(name: str) -> dict[str, list[int]]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    data = yaml.load(_real(f"keys/sd-mecha/{name}").read_text(), Loader=loader)
    return {k: v["shape"] for comp in data["components"].values() for k, v in comp.items()}


def _modules(keys: dict[str, list[int]], prefix: str) -> dict[str, dict[str, list[int]]]:
    """``{prefix}a.b.weight`` -> ``{"a.b": {"weight": shape}}``."""
    out: dict[str, dict[str, list[int]]] = {}
    for key, shape in keys.items():
        if key.startswith(prefix):
            module, _, leaf = key[len(prefix) :].rpartition(".")
            out.setdefault(module, {})[leaf] = shape
    return out


def _param_modules(unet: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in unet.named_modules() if next(m.parameters(recurse=False), None) is not None}


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    return {n: list(p.shape) for n, p in module.named_parameters(recurse=False)}


def test_real_data_present() -> None:
    assert SHARED.is_dir(), f"shared checkout missing at {SHARED}"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_original_key_maps_to_a_module_of_the_same_shape(model: str) -> None:
    config_file, original_file, _ = MODELS[model]
    unet = _unet(config_file)
    mapping = unet_original_names(unet)
    modules = _param_modules(unet)
    original = _modules(_yaml_keys(original_file), UNET_PREFIX)
    assert len(original) > 300

    unmapped = sorted(set(original) - set(mapping))
    assert not unmapped, f"{len(unmapped)} original modules unmapped, e.g. {unmapped[:10]}"
    not_in_checkpoint = sorted(set(mapping) - set(original))
    assert not not_in_checkpoint, f"map invents original names: {not_in_checkpoint[:10]}"
    wrong = {
        name: (mapping[name], leaves, _shapes(modules[mapping[name]]))
        for name, leaves in original.items()
        if _shapes(modules[mapping[name]]) != leaves
    }
    assert not wrong, f"{len(wrong)} shape mismatches, e.g. {list(wrong.items())[:5]}"


def test_sdxl_kohya_checkpoint_uses_the_same_original_names() -> None:
    # kohya's SDXL checkpoint format keeps sgm names under a ``unet.`` prefix.
    sgm = _modules(_yaml_keys("sdxl-sgm.yaml"), UNET_PREFIX)
    kohya = _modules(_yaml_keys("sdxl-kohya.yaml"), "unet.")
    assert kohya == sgm
    assert set(kohya) == set(unet_original_names(_unet(MODELS["sdxl"][0])))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_map_is_a_bijection_onto_diffusers_parameterised_modules(model: str) -> None:
    config_file, _, (diffusers_file, diffusers_prefix) = MODELS[model]
    unet = _unet(config_file)
    mapping = unet_original_names(unet)
    modules = _param_modules(unet)

    targets = list(mapping.values())
    duplicates = sorted({t for t in targets if targets.count(t) > 1})
    assert not duplicates, f"diffusers modules hit more than once: {duplicates[:10]}"
    assert not set(targets) - set(modules), "map points at modules that do not exist or own no params"
    assert set(modules) - set(targets) == EXPECTED_UNMAPPED[model]

    # The meta model's parameterised modules are exactly those of a real diffusers-named file.
    real = _modules(_yaml_keys(diffusers_file), diffusers_prefix)
    assert {name: _shapes(modules[name]) for name in targets} == real


def test_refiner_structure_follows_the_index_arithmetic() -> None:
    # No original key list for the refiner: check the bijection and the documented
    # ``input_blocks.{(k+1)*i + j + 1}`` / ``output_blocks.{(k+1)*i + j}`` numbering
    # (levels without attention and transformer_layers_per_block=4 both differ from base).
    unet = _unet("sdxl-refiner__unet_config.json")
    mapping = unet_original_names(unet)
    modules = _param_modules(unet)
    assert len(set(mapping.values())) == len(mapping)
    assert set(modules) - set(mapping.values()) == EXPECTED_UNMAPPED["sdxl-refiner"]

    k = unet.config.layers_per_block
    # (original stack, slot, diffusers stack, kind, index offset)
    patterns = [
        ("input_blocks", 0, "down_blocks", "resnets", 1),
        ("input_blocks", 1, "down_blocks", "attentions", 1),
        ("output_blocks", 0, "up_blocks", "resnets", 0),
        ("output_blocks", 1, "up_blocks", "attentions", 0),
    ]
    checked = 0
    for original, diffusers_name in mapping.items():
        for stack, slot, block, kind, offset in patterns:
            o = re.fullmatch(rf"{stack}\.(\d+)\.{slot}\.(.+)", original)
            d = re.fullmatch(rf"{block}\.(\d+)\.{kind}\.(\d+)\.(.+)", diffusers_name)
            if o and d:
                i, j = int(d.group(1)), int(d.group(2))
                assert int(o.group(1)) == (k + 1) * i + j + offset, (original, diffusers_name)
                checked += 1
    assert checked > 0.8 * len(mapping)
    for i in range(len(unet.down_blocks) - 1):
        assert mapping[f"input_blocks.{(k + 1) * (i + 1)}.0.op"] == f"down_blocks.{i}.downsamplers.0.conv"
    for i, block in enumerate(unet.up_blocks[:-1]):
        slot = 2 if hasattr(block, "attentions") else 1
        assert mapping[f"output_blocks.{(k + 1) * i + k}.{slot}.conv"] == f"up_blocks.{i}.upsamplers.0.conv"
    assert (
        mapping["middle_block.1.transformer_blocks.3.attn2.to_k"]
        == "mid_block.attentions.0.transformer_blocks.3.attn2.to_k"
    )
    assert mapping["label_emb.0.0"] == "add_embedding.linear_1"


# SD2 has no real config here: derive it from SD1.5's with the SD2 differences (heads, 1024-dim
# text, linear proj_in/proj_out).  ai-toolkit has names only, so only names are compared.
AI_TOOLKIT = {
    "sd1": ("sd15__unet_config.json", {}),
    "sd2": (
        "sd15__unet_config.json",
        {"attention_head_dim": (5, 10, 20, 20), "cross_attention_dim": 1024, "use_linear_projection": True},
    ),
    "sdxl": ("sdxl-base__unet_config.json", {}),
}


@pytest.mark.parametrize("model", sorted(AI_TOOLKIT))
def test_agrees_with_ai_toolkit_keymaps(model: str) -> None:
    config_file, overrides = AI_TOOLKIT[model]
    mapping = unet_original_names(_unet(config_file, **overrides))
    keymap = json.loads(_real(f"keys/ai-toolkit/stable_diffusion_{model}.json").read_text())
    pairs = {
        k[len(UNET_PREFIX) :].rpartition(".")[0]: v.removeprefix("unet_").rpartition(".")[0]
        for k, v in keymap["ldm_diffusers_keymap"].items()
        if k.startswith(UNET_PREFIX)
    }
    assert len(pairs) > 300
    # every entry, not a sample: it is cheap
    disagree = {o: (d, mapping.get(o)) for o, d in pairs.items() if mapping.get(o) != d}
    assert not disagree, f"{len(disagree)} disagreements, e.g. {list(disagree.items())[:5]}"
    assert set(pairs) == set(mapping)


def test_nonstandard_unet_leaves_original_names_unmapped(caplog):
    """A UNet2DConditionModel whose blocks lack `resnets` (a partial folder) used to crash with an
    AttributeError; now original names stay unmapped (typed misses) and diffusers names still land."""
    from helpers.tiny_models import tiny_sdxl_unet
    from safetensors.torch import save_file

    import loraweave

    unet = tiny_sdxl_unet()
    del unet.down_blocks[0].resnets
    from loraweave.arch.unet_original import _TOP_LEVEL

    assert set(unet_original_names(unet)) <= set(_TOP_LEVEL)  # only names outside the blocks
    assert "unet_original=skipped" in caplog.text
    g = torch.Generator().manual_seed(0)
    rows = {"lora_unet_input_blocks_4_1_proj_in": (32, 32), "lora_unet_time_embed_0": (64, 16)}
    sd = {}
    for name, (out_f, in_f) in rows.items():
        sd[f"{name}.lora_down.weight"] = torch.randn(4, in_f, generator=g)
        sd[f"{name}.lora_up.weight"] = torch.randn(out_f, 4, generator=g)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ldm.safetensors"
        save_file(sd, str(path))
        report = loraweave.apply(unet, str(path), mode="merge", strict=False).report
    unmatched = {m["key"] for m in report.to_dict()["unmatched"]}
    assert any("input_blocks_4_1_proj_in" in k for k in unmatched)
    assert report.keys_applied == 2  # time_embed.0 is a top-level name and still lands
