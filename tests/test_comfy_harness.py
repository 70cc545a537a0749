"""The headless ComfyUI harness and its tiny models (tests/helpers/comfy_env.py, comfy_models.py): ComfyUI's
own detection picks the classes, the diffusers twins hold the same weights (checked through diffusers'
single-file converter for the UNets), and the CLIPs encode a prompt."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_env import COMFYUI_DIR, import_comfy
from helpers.comfy_models import BUILDERS, flux_rows_map, rows_of


@pytest.fixture(scope="module")
def models():
    return {name: build() for name, build in BUILDERS.items()}


def test_comfy_runs_headless_on_cpu_from_shared():
    c = import_comfy()
    assert c.model_patcher.__file__.startswith(str(COMFYUI_DIR))
    assert str(c.model_management.get_torch_device()) == "cpu"


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_unet_twin_matches_diffusers_single_file_converter(models, name):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    m = models[name]
    ldm = {f"model.diffusion_model.{k}": v for k, v in m.patcher.model.diffusion_model.state_dict().items()}
    converted = convert_ldm_unet_checkpoint(ldm, dict(m.diffusers.config))
    twin = m.diffusers.state_dict()
    assert converted.keys() == twin.keys()
    for key, value in converted.items():
        assert torch.equal(value, twin[key]), key
    assert type(m.patcher.model.model_config).__name__ == {"sd15": "SD15", "sdxl": "SDXL"}[name]


def test_flux_is_detected_by_comfy_and_twin_holds_its_rows(models):
    m = models["flux"]
    config = m.patcher.model.model_config.unet_config
    assert (config["hidden_size"], config["depth"], config["depth_single_blocks"]) == (128, 1, 1)
    comfy_sd = m.patcher.model.diffusion_model.state_dict()
    twin = m.diffusers.state_dict()
    mapped = {k: v for k, v in flux_rows_map(m.patcher).items() if k in twin}
    assert mapped.keys() == twin.keys()
    for key, where in mapped.items():
        assert torch.equal(rows_of(comfy_sd, where), twin[key]), key


def test_wan_is_detected_by_comfy_and_twin_holds_its_weights(models):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    m = models["wan"]
    assert type(m.patcher.model.model_config).__name__ == "WAN21_T2V"
    converted = convert_wan_transformer_to_diffusers(dict(m.patcher.model.diffusion_model.state_dict()))
    twin = m.diffusers.state_dict()
    assert converted.keys() == twin.keys()
    assert all(torch.equal(converted[k], twin[k]) for k in twin)


@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_clip_encodes_a_prompt(models, name):
    clip = models[name].clip
    cond, pooled = clip.encode_from_tokens(clip.tokenize("a photo of a cat"), return_pooled=True)
    width = {"sd15": 32, "sdxl": 64, "flux": 32}[name]  # SDXL concatenates clip_l and clip_g
    assert cond.shape[0] == 1 and cond.shape[-1] == width and torch.isfinite(cond).all()
