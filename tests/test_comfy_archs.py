"""loraweave.comfy on the DiT architectures beyond SD/Flux/Wan, each a tiny model built the way ComfyUI loads it
(helpers.comfy_models: ComfyUI's own detection). References, per architecture:
- merge: `loraweave.apply` on the diffusers twin holding the same weights, ComfyUI's merged weights mapped to the
  twin's names by the row map named in ARCHS (1e-6 relative per weight);
- ComfyUI's own LoraLoader: bit-identical wherever it lands the same keys within that tolerance;
- runtime: the model's forward with mode="runtime" within 1e-5 (absolute, outputs of magnitude ~1) of the merge."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_files import FAMILIES, adapter_file, dotted, kohya
from helpers.comfy_models import ComfyModel, tiny_qwen_image, tiny_z_image

import loraweave
from loraweave.comfy import load_lora_for_models

TOL = 1e-6  # relative, per weight: fp32 through two independent paths
FORWARD_ATOL = 1e-5
STRENGTH = 0.7


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


def merged_state(patcher) -> dict[str, torch.Tensor]:
    """The diffusion model's weights as ComfyUI's merge writes them, without the `diffusion_model.` prefix."""
    prefix, out = "diffusion_model.", {}
    for key, value in patcher.model.state_dict().items():
        if not key.startswith(prefix):
            continue
        patched = key in patcher.patches
        out[key[len(prefix) :]] = (
            patcher.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
            if patched
            else value.detach().clone()
        )
    return out


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def twin_reference(m: ComfyModel, sd: dict) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(m.diffusers)
    loraweave.apply(twin, sd, mode="merge", strength=STRENGTH)
    return twin.state_dict()


def check_against_twin(name: str, m: ComfyModel, sd: dict):
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    ours = ARCHS[name].as_diffusers(m, merged_state(model))
    ref = twin_reference(m, sd)
    errors = {k: rel(ours[k], ref[k]) for k in ref}
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])
    base = m.diffusers.state_dict()
    changed = [k for k in ref if not torch.equal(ref[k], base[k])]
    assert len(changed) >= 8, "the file changed too little: the check would prove nothing"
    return model


def comfy_core_verdict(name: str, m: ComfyModel, model, sd: dict) -> str:
    """How ComfyUI's own LoraLoader does on the file next to ours: "drops" (it patches other keys), "off" (its
    weights miss the twin reference by more than TOL), "close" (within TOL, bits differ) or "identical"."""
    core, _ = import_comfy().sd.load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0)
    if set(core.patches) != set(model.patches):
        return "drops"
    theirs, ours, ref = merged_state(core), merged_state(model), twin_reference(m, sd)
    theirs_diffusers = ARCHS[name].as_diffusers(m, theirs)
    if max(rel(theirs_diffusers[k], ref[k]) for k in ref) > TOL:
        return "off"
    return "identical" if all(torch.equal(theirs[k], ours[k]) for k in theirs) else "close"


# ComfyUI v0.19.3 on a kohya LoRA, by layout: it maps Z-Image's original names only, and there its fused-qkv and
# SwiGLU merges are bit-identical to ours ("close" until the comfy merge formed ΔW in core's op order: mm, then
# scale, then add; an alpha-fused addmm rounds differently).
CORE_VERDICTS = {
    ("qwen-image", "diffusers"): "identical",
    ("qwen-image", "comfy"): "identical",
    ("z-image", "diffusers"): "drops",
    ("z-image", "comfy"): "identical",
}


def block_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every Linear inside the model's block lists but the modulation (attention, fused qkv, SwiGLU); the
    modulation's 4-6x wide outputs would only slow the check."""
    return {
        n: mod
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and re.match(r"^\w+\.\d+\.(?!\w*mod)", n)
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
    c = import_comfy()
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", kohya(ARCHS[name].kohya_prefix))
    outputs = []
    for mode in ("merge", "runtime", None):
        model = (
            m.patcher
            if mode is None
            else load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode=mode)[0]
        )
        c.model_management.load_models_gpu([model])
        with torch.no_grad():
            outputs.append(ARCHS[name].forward(m, model))
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    merged, runtime, base = outputs
    assert (merged - base).abs().max() > 100 * FORWARD_ATOL, "the adapter changed nothing"
    assert torch.allclose(runtime, merged, rtol=0, atol=FORWARD_ATOL), (runtime - merged).abs().max()


@pytest.mark.parametrize("name", list(ARCHS))
def test_reference_tree_at_model_widths(models, name, caplog):
    # The adapter resolves on the diffusers tree at the tiny model's widths (reference.py reads ComfyUI's config),
    # not on the fallback of ComfyUI's own names that a fits=no WARNING announces.
    from loraweave.comfy.targets import reference_tree

    m = built(models, name)
    with caplog.at_level("WARNING", logger="loraweave"):
        found = reference_tree(m.patcher)
    assert found is not None and "fits=no" not in caplog.text
    tree_shapes = {k: tuple(v.shape) for k, v in found[0].state_dict().items()}
    assert tree_shapes == {k: tuple(v.shape) for k, v in m.diffusers.state_dict().items()}


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
