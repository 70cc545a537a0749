"""The recipe for a new architecture, ComfyUI included: the toy of tests/helpers/toy_arch.py, declared in that
one file with its alias table and ComfyUI facets (arch/record.py ComfyFacets), is registered
(arch.registry.registered) and a LoRA in its diffusers names lands through
loraweave.comfy.load_lora_for_models on ComfyUI's own model of it, whose module names and widths differ (a
fused `blocks.N.mix_gate` at hidden 6, 3 blocks, against the catalog's 8 wide, 4 deep): no file of the package
names it, and nothing of the package is patched (the one patch puts the toy class in the `diffusers`
namespace, see `toy_world`). Reference: the fp64 formula W + s·B·A on the rows of ComfyUI's fused tensor (a
PEFT file without alpha: γ = 1), TOL = 1e-6 relative per weight (fp32 merge against fp64). Negative controls:
the toy not registered, registered without its ComfyUI facets, and with facets but no config rule (the
catalog's width-8 tree then does not fit): no key lands."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.comfy_checks import STRENGTH, TOL, merged_state, rel
from helpers.comfy_env import import_comfy
from helpers.toy_arch import TOY, ToyTransformer, comfy_toy, toy_lora

from loraweave.arch.registry import registered
from loraweave.comfy import load_lora_for_models, targets
from loraweave.errors import NoKeysLandedError

HIDDEN, LAYERS = 6, 3


@pytest.fixture
def toy_world(monkeypatch):
    """The toy's class where the ComfyUI pack builds reference trees from (the `diffusers` namespace): the
    facets name no shipped skeleton, and no skeleton the pack ships serves a test-only class, so the tree is
    built from the class as from diffusers' own. Reference trees built before or after are not reused."""
    import_comfy()
    import diffusers

    monkeypatch.setattr(diffusers, "ToyTransformer", ToyTransformer, raising=False)
    targets._meta_tree.cache_clear()
    yield comfy_toy(HIDDEN, LAYERS)
    targets._meta_tree.cache_clear()


def expected(base: dict[str, torch.Tensor], sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{ComfyUI weight: W + s·B·A in fp64}: mix on the first HIDDEN rows of blocks.N.mix_gate, gate on the
    rest."""
    out = {}
    for i in range(LAYERS):
        key = f"blocks.{i}.mix_gate.weight"
        weight = base[key].double().clone()
        for j, name in enumerate(("mix", "gate")):
            stem = f"transformer.toy_blocks.{i}.{name}"
            delta = sd[f"{stem}.lora_B.weight"].double() @ sd[f"{stem}.lora_A.weight"].double()
            weight[j * HIDDEN : (j + 1) * HIDDEN] += STRENGTH * delta
        out[key] = weight
    return out


def test_a_toy_architecture_in_one_file_lands_through_comfyui(toy_world):
    model_in = toy_world
    sd = toy_lora(depth=LAYERS, width=HIDDEN)
    base = {k: v.clone() for k, v in model_in.model.diffusion_model.state_dict().items()}
    with registered(TOY, before="unet"):
        assert targets.comfy_arch(model_in) == "toy-dit"
        model, _, report = load_lora_for_models(model_in, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    merged, ref = merged_state(model), expected(base, sd)
    errors = {k: rel(merged[k], ref[k]) for k in ref}
    assert max(errors.values()) <= TOL, errors
    assert all(not torch.equal(merged[k], base[k]) for k in ref)
    assert torch.equal(merged["proj_in.weight"], base["proj_in.weight"])  # no key names it
    after = model_in.model.diffusion_model.state_dict()
    assert (
        all(torch.equal(after[k], base[k]) for k in base) and not model_in.patches
    )  # the input is untouched


@pytest.mark.parametrize("record", ["unregistered", "no-facets", "no-config"])
def test_without_the_facets_no_key_lands(toy_world, record):
    sd = toy_lora(depth=LAYERS, width=HIDDEN)
    if record == "unregistered":
        with pytest.raises(NoKeysLandedError):
            load_lora_for_models(toy_world, None, sd, STRENGTH, 0.0, mode="merge")
        return
    changed = (
        dataclasses.replace(TOY, comfy=None)
        if record == "no-facets"
        else dataclasses.replace(TOY, comfy=dataclasses.replace(TOY.comfy, config=None))
    )
    with registered(changed, before="unet"), pytest.raises(NoKeysLandedError) as raised:
        load_lora_for_models(toy_world, None, sd, STRENGTH, 0.0, mode="merge")
    reasons = {u.reason for u in raised.value.report.unmatched}
    if record == "no-config":  # mapped, but the catalog's width-8 tree does not fit ComfyUI's hidden 6
        assert all("toy-dit reference does not fit this model's widths" in r for r in reasons), reasons
