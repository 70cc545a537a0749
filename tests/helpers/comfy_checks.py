"""Checks shared by the tests of loraweave.comfy on tiny DiTs (test_comfy_arch_*.py).

References: `loraweave.apply` on the diffusers twin holding the same weights, ComfyUI's merged weights mapped
to the twin's names by the model's row map (`as_diffusers`), TOL relative per weight; ComfyUI's own LoraLoader
next to ours; the runtime forward against the merge."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import torch

import loraweave
from loraweave.comfy import load_lora_for_models

from .comfy_env import import_comfy
from .comfy_models import ComfyModel

TOL = 1e-6  # relative, per weight: fp32 through two independent paths
FORWARD_ATOL = 1e-5
STRENGTH = 0.7
RowMap = Callable[[dict], dict]  # ComfyUI state (its names) -> the twin's names


def comfy_modules(m) -> torch.nn.Module:
    """ComfyUI's diffusion model inside a test model's MODEL (its own module names)."""
    return m.patcher.model.diffusion_model


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


def check_against_twin(as_diffusers: RowMap, m: ComfyModel, sd: dict, min_changed: int = 8):
    """Our merge (every key lands) equals loraweave.apply on the twin within TOL; returns the patched
    MODEL."""
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    ours = as_diffusers(merged_state(model))
    ref = twin_reference(m, sd)
    assert set(ours) == set(ref), sorted(set(ours) ^ set(ref))[:6]
    errors = {k: rel(ours[k], ref[k]) for k in ref}
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])
    base = m.diffusers.state_dict()
    changed = [k for k in ref if not torch.equal(ref[k], base[k])]
    assert len(changed) >= min_changed, "the file changed too little: the check would prove nothing"
    return model


def comfy_core_verdict(as_diffusers: RowMap, m: ComfyModel, model, sd: dict) -> str:
    """How ComfyUI's own LoraLoader does on the file next to ours: "drops" (it patches other keys), "off" (its
    weights miss the twin reference by more than TOL), "close" (within TOL, bits differ) or "identical"."""
    core, _ = import_comfy().sd.load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0)
    if set(core.patches) != set(model.patches):
        return "drops"
    theirs, ours, ref = merged_state(core), merged_state(model), twin_reference(m, sd)
    theirs_diffusers = as_diffusers(theirs)
    if max(rel(theirs_diffusers[k], ref[k]) for k in ref) > TOL:
        return "off"
    return "identical" if all(torch.equal(theirs[k], ours[k]) for k in theirs) else "close"


def block_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every Linear inside the model's block lists but the modulation (attention, fused qkv, SwiGLU); the
    modulation's 4-6x wide outputs would only slow the check."""
    return {
        n: mod
        for n, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and re.match(r"^\w+\.\d+\.(?!\w*mod)", n)
    }


def all_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """Every Linear of the model: embedders, modulation, refiners and final layers included."""
    return {n: mod for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}


def runtime_and_merge(m: ComfyModel, sd: dict, forward) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(merged, runtime, base) outputs of `forward(m, MODEL)` with the file loaded by our node in each
    mode."""
    c = import_comfy()
    outputs = []
    for mode in ("merge", "runtime", None):
        model = (
            m.patcher
            if mode is None
            else load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode=mode)[0]
        )
        c.model_management.load_models_gpu([model])
        with torch.no_grad():
            outputs.append(forward(m, model))
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    merged, runtime, base = outputs
    return merged, runtime, base


def check_reference_tree(m: ComfyModel, caplog) -> None:
    """Keys resolve on the diffusers tree at the model's own widths (reference.py reads ComfyUI's
    unet_config), not on the fallback of ComfyUI's own names that a fits=no WARNING announces."""
    from loraweave.comfy.targets import reference_tree

    with caplog.at_level("WARNING", logger="loraweave"):
        found = reference_tree(m.patcher)
    assert found is not None and "fits=no" not in caplog.text
    tree_shapes = {k: tuple(v.shape) for k, v in found[0].state_dict().items()}
    assert tree_shapes == {k: tuple(v.shape) for k, v in m.diffusers.state_dict().items()}
