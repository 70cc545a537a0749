"""The pack where diffusers is not installed (ComfyUI does not ship it; a registry install of the pack brings
only what ComfyUI has). A model no shipped skeleton fits (here the tiny Flux: width 128) needs diffusers'
classes for its reference tree. Without them the loader used to end in a bare ModuleNotFoundError; now keys
resolve by ComfyUI's own module names (a kohya file lands, on the same weights as with diffusers), and every
key that misses says why. Reference: the same loader with diffusers importable."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_models import tiny_flux
from helpers.comfy_pack import flux_lora, lora_pair

from loraweave.comfy import load_lora_for_models, targets
from loraweave.errors import NoKeysLandedError
from loraweave.formats.adapter import load_adapter

pytestmark = pytest.mark.comfy

DIFFUSERS_NAMED = "transformer.transformer_blocks.0.attn.to_out.0"  # img_attn.proj in ComfyUI's names


@pytest.fixture(scope="module")
def flux():
    import_comfy()
    return tiny_flux()


@pytest.fixture
def no_diffusers(monkeypatch):
    targets._meta_tree.cache_clear()  # a tree built with diffusers earlier in the session would hide the case
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ModuleNotFoundError
    yield
    targets._meta_tree.cache_clear()


def _merged(patcher, key: str) -> torch.Tensor:
    c = import_comfy()
    return c.lora.calculate_weight(patcher.patches[key], patcher.get_model_object(key).detach().clone(), key)


def test_kohya_file_lands_by_comfy_names_and_diffusers_keys_say_why(flux, no_diffusers):
    sd = {**flux_lora(), **lora_pair(DIFFUSERS_NAMED, 128, 128, 11)}
    model, _, report = load_lora_for_models(flux.patcher, None, sd, 0.7, 0.0, mode="merge")
    assert report.keys_applied == 6  # the kohya file's 6 keys, by ComfyUI's own names
    missed = {u.key: u.reason for u in report.unmatched}
    assert set(missed) == {f"{DIFFUSERS_NAMED}.{r}" for r in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert all("diffusers is not installed" in why and "pip install" in why for why in missed.values())


def test_same_weights_as_with_diffusers(flux, no_diffusers, monkeypatch):
    sd = flux_lora()
    without, _, _ = load_lora_for_models(flux.patcher, None, sd, 0.7, 0.0, mode="merge")
    monkeypatch.delitem(sys.modules, "diffusers")
    targets._meta_tree.cache_clear()
    with_it, _, report = load_lora_for_models(flux.patcher, None, sd, 0.7, 0.0, mode="merge")
    assert report.keys_applied == 6
    assert set(without.patches) == set(with_it.patches)
    for key in with_it.patches:
        assert torch.equal(_merged(without, key), _merged(with_it, key)), key


def test_a_file_of_diffusers_names_only_is_a_typed_error_that_says_why(flux, no_diffusers):
    before = flux.patcher.patches_uuid
    with pytest.raises(NoKeysLandedError) as caught:
        load_lora_for_models(flux.patcher, None, lora_pair(DIFFUSERS_NAMED, 128, 128, 11), 1.0, 0.0)
    reasons = {u.reason for u in caught.value.report.unmatched}
    assert reasons and all("diffusers is not installed" in why for why in reasons)
    assert flux.patcher.patches_uuid == before and not flux.patcher.patches


def test_full_width_flux_fill_needs_no_diffusers(no_diffusers):
    # Flux Fill's 384 input channels are served by the shipped Flux skeleton (x_embedder and proj_out
    # resized), so a diffusers-named Fill LoRA lands on the full-size model without diffusers' classes.
    from helpers.realsize_comfy import meta_flux_patcher

    patcher = meta_flux_patcher(detected_as="FluxInpaint", in_channels=96, out_channels=16)
    sd = {
        **lora_pair("transformer.x_embedder", 3072, 384, 1),
        **lora_pair("transformer.transformer_blocks.0.attn.to_q", 3072, 3072, 2),
        **lora_pair("transformer.single_transformer_blocks.0.proj_mlp", 12288, 3072, 3),
        **lora_pair("transformer.proj_out", 64, 3072, 4),
    }
    plan = targets.plan_for_patcher(patcher, load_adapter(sd))
    assert not plan.unmatched
    landed = {piece.module for pp in plan.planned for piece in pp.pieces}
    assert landed == {
        "img_in",
        "double_blocks.0.img_attn.qkv",
        "single_blocks.0.linear1",
        "final_layer.linear",
    }


def test_block_weights_say_that_diffusers_is_missing(flux, no_diffusers):
    from loraweave.comfy.stack import apply_stack
    from loraweave.errors import ArgumentError

    with pytest.raises(ArgumentError, match="no block map for this model: .*diffusers is not installed"):
        apply_stack(flux.patcher, None, [(flux_lora(), 1.0, 1.0)], block_weights="1,0.5,1", mode="merge")
