"""loraweave.comfy on the DiT architectures beyond SD/Flux/Wan, each a tiny model built the way ComfyUI loads it
(helpers.comfy_models: ComfyUI's own detection). References, per architecture:
- merge: `loraweave.apply` on the diffusers twin holding the same weights, ComfyUI's merged weights mapped to the
  twin's names by the row map named in ARCHS (1e-6 relative per weight);
- ComfyUI's own LoraLoader: bit-identical wherever it lands the same keys within that tolerance;
- runtime: the model's forward with mode="runtime" within 1e-5 (absolute, outputs of magnitude ~1) of the merge."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers import comfy_checks as checks
from helpers.comfy_checks import (
    FORWARD_ATOL,
    STRENGTH,
    TOL,
    block_linears,
    check_reference_tree,
    rel,
    runtime_and_merge,
    twin_reference,
)
from helpers.comfy_env import import_comfy
from helpers.comfy_files import FAMILIES, adapter_file, dotted, kohya
from helpers.comfy_models import ComfyModel, tiny_qwen_image, tiny_z_image

from loraweave.comfy import load_lora_for_models


def identity_rows(m: ComfyModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: state[k] for k in m.diffusers.state_dict()}


def qwen_forward(m: ComfyModel, model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 1, 4, 4, generator=g)
    context = torch.randn(1, 5, 32, generator=g)
    return model.model.diffusion_model(x, torch.tensor([0.5]), context)


def z_image_rows(m: ComfyModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return convert_z_image_transformer_checkpoint_to_diffusers(dict(state))


def z_image_forward(m: ComfyModel, model) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 4, 4, generator=g)
    context = torch.randn(1, 5, 32, generator=g)
    return model.model.diffusion_model(x, torch.tensor([0.5]), context, 5)


@dataclass(frozen=True)
class ArchCase:
    build: Callable[[], ComfyModel]
    as_diffusers: Callable[[ComfyModel, dict], dict]  # ComfyUI state -> twin names (the row map)
    kohya_prefix: str
    forward: Callable[[ComfyModel, object], torch.Tensor]


# Row maps: Qwen-Image's is the identity (ComfyUI keeps the diffusers names; diffusers has no converter for it);
# Z-Image's is diffusers' single-file converter (fused attention.qkv split in three).
ARCHS = {
    "qwen-image": ArchCase(tiny_qwen_image, identity_rows, "lora_unet_", qwen_forward),
    "z-image": ArchCase(tiny_z_image, z_image_rows, "lora_unet_", z_image_forward),
}


@pytest.fixture(scope="module")
def models():
    return {}


def built(models, name: str) -> ComfyModel:
    if name not in models:
        models[name] = ARCHS[name].build()
    return models[name]


def rows(name: str, m: ComfyModel):
    return lambda state: ARCHS[name].as_diffusers(m, state)


def check_against_twin(name: str, m: ComfyModel, sd: dict):
    return checks.check_against_twin(rows(name, m), m, sd)


def comfy_core_verdict(name: str, m: ComfyModel, model, sd: dict) -> str:
    return checks.comfy_core_verdict(rows(name, m), m, model, sd)


# ComfyUI v0.19.3 on a kohya LoRA, by layout: it maps Z-Image's original names only, and there its fused-qkv and
# SwiGLU merges are bit-identical to ours ("close" until the comfy merge formed ΔW in core's op order: mm, then
# scale, then add; an alpha-fused addmm rounds differently).
CORE_VERDICTS = {
    ("qwen-image", "diffusers"): "identical",
    ("qwen-image", "comfy"): "identical",
    ("z-image", "diffusers"): "drops",
    ("z-image", "comfy"): "identical",
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(ARCHS))
def test_kohya_on_diffusers_names(models, name, family):
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), family, kohya(ARCHS[name].kohya_prefix))
    model = check_against_twin(name, m, sd)
    if family == "lora":
        assert comfy_core_verdict(name, m, model, sd) == CORE_VERDICTS[name, "diffusers"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(ARCHS))
def test_kohya_on_comfy_names(models, name, family):
    # ComfyUI's own (original) module names: a fused qkv lands per row range on the twin's to_q/to_k/to_v.
    m = built(models, name)
    sd = adapter_file(block_linears(m.patcher.model.diffusion_model), family, kohya(ARCHS[name].kohya_prefix))
    model = check_against_twin(name, m, sd)
    if family == "lora":
        assert comfy_core_verdict(name, m, model, sd) == CORE_VERDICTS[name, "comfy"]


@pytest.mark.parametrize("name", list(ARCHS))
def test_peft_diffusers_layout(models, name):
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", dotted("transformer."), peft=True)
    check_against_twin(name, m, sd)


@pytest.mark.parametrize("name", list(ARCHS))
def test_runtime_forward_equals_merge(models, name):
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", kohya(ARCHS[name].kohya_prefix))
    merged, runtime, base = runtime_and_merge(m, sd, ARCHS[name].forward)
    assert (merged - base).abs().max() > 100 * FORWARD_ATOL, "the adapter changed nothing"
    assert torch.allclose(runtime, merged, rtol=0, atol=FORWARD_ATOL), (runtime - merged).abs().max()


@pytest.mark.parametrize("name", list(ARCHS))
def test_reference_tree_at_model_widths(models, name, caplog):
    # The adapter resolves on the diffusers tree at the tiny model's widths (reference.py reads ComfyUI's config),
    # not on the fallback of ComfyUI's own names that a fits=no WARNING announces.
    check_reference_tree(built(models, name), caplog)


def test_z_image_x_pad_token_lands(models):
    # x_pad_token is a parameter of the root NextDiT (a module with children): ComfyUI accepts a "diff" patch there
    # and never applies it, so it must land as an object patch, equal to loraweave.apply's on the twin.
    c = import_comfy()
    m = built(models, "z-image")
    delta = torch.randn(1, 1024, generator=torch.Generator().manual_seed(4))
    sd = {"diffusion_model.x_pad_token.diff": delta}
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == 1, report.kinds()
    c.model_management.load_models_gpu([model])
    landed = model.model.diffusion_model.x_pad_token.detach().clone()
    c.model_management.unload_all_models()
    model.detach(unpatch_all=True)
    ref = twin_reference(m, sd)["x_pad_token"]
    assert not torch.equal(ref, m.diffusers.x_pad_token)
    assert rel(landed, ref) <= TOL
    assert torch.equal(
        m.patcher.model.diffusion_model.x_pad_token, m.diffusers.x_pad_token
    )  # input untouched
