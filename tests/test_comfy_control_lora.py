"""A BFL Flux control LoRA (Canny/Depth layout: `img_in` 64 -> 128 columns, lora_B biases, norm scales)
through the pack on ComfyUI's own Flux, against core ComfyUI's own load of the same file.

Checked, merge / runtime / auto: no crash; the merged weights equal core's (`comfy.sd.load_lora_for_models`:
img_in zero-padded and widened, norms replaced) within 1e-6; a sample through ComfyUI's executor with the
control latent in the conditioning (ComfyUI's Flux concatenates it because img_in takes the extra columns)
equals core's within 1e-5, at the first strength and after a re-queue with another one while the grown model
is still loaded; unloading gives back the original model, img_in on its original storage. A
file whose img_in asks for a width ComfyUI does not feed is refused with a typed error naming the file and
the key, nothing changed."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_control import TestFluxControlConditioning, control_lora, control_prompt
from helpers.comfy_env import import_comfy
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    CAPTURED,
    REGISTRY,
    core_lora,
    flux_fixture,
    make_executor,
    nothing_loaded_fixture,
    register_test_nodes,
    run_prompt,
    sampling_prompt,
    unload_all,
)
from safetensors.torch import save_file

from loraweave.comfy.api import load_lora_for_models
from loraweave.errors import TargetError

pytestmark = pytest.mark.usefixtures("one_thread", "nothing_loaded")
ATOL = 1e-5  # the LATENTs (|x| ~ 3): core merges, ours merges or runs paths; fp32 sums in other orders
WEIGHT_RTOL = 1e-6


@pytest.fixture(autouse=True)
def workflow(flux, monkeypatch):
    import nodes

    register_test_nodes(monkeypatch)
    monkeypatch.setitem(
        nodes.NODE_CLASS_MAPPINGS, "LWTestFluxControlConditioning", TestFluxControlConditioning
    )
    monkeypatch.setitem(REGISTRY, "base", flux)
    monkeypatch.setitem(REGISTRY, "canny", control_lora(flux))
    CAPTURED.clear()


def latent_of(loras: list[tuple[str, float, str]], executor=None) -> torch.Tensor:
    tag = f"run{len(CAPTURED)}"
    run_prompt(executor or make_executor(), control_prompt(sampling_prompt(loras, tag)))
    return CAPTURED[tag]


def state_of(flux) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in flux.model.diffusion_model.state_dict().items()}


def patched_state(flux, patcher) -> dict[str, torch.Tensor]:
    """The diffusion model's tensors while `patcher` is patched in, then unpatched again."""
    patcher.patch_model()
    try:
        return state_of(flux)
    finally:
        patcher.unpatch_model()
        unload_all(patcher, flux)


def assert_original(flux, original: dict[str, torch.Tensor], img_in: torch.Tensor) -> None:
    now_img_in = flux.model.diffusion_model.img_in.weight  # ComfyUI re-wraps the backup in a new Parameter
    assert now_img_in.shape == img_in.shape and now_img_in.data_ptr() == img_in.data_ptr()
    now = state_of(flux)
    assert now.keys() == original.keys()
    for key, value in original.items():
        assert torch.equal(now[key], value), key


@pytest.mark.parametrize("strength", [1.0, 0.7])
@pytest.mark.parametrize("mode", ["merge", "auto"])
def test_merged_weights_equal_core(flux, mode, strength):
    original, img_in = state_of(flux), flux.model.diffusion_model.img_in.weight
    lora = REGISTRY["canny"]
    core = patched_state(flux, core_lora(flux, dict(lora), strength))
    ours, _, report = load_lora_for_models(flux, None, lora, strength, 0.0, mode=mode)
    assert report.keys_applied == len(lora) and not report.unmatched
    (row,) = [m for m in report.applied if m.module == "img_in"]
    assert any("input grown 64 -> 128" in n for n in row.notes), row
    got = patched_state(flux, ours)
    assert core["img_in.weight"].shape == (128, 128)
    for key, value in core.items():
        torch.testing.assert_close(got[key], value, rtol=WEIGHT_RTOL, atol=0, msg=key)
    assert_original(flux, original, img_in)


def test_runtime_widens_img_in_as_core_and_adds_no_weight(flux):
    original, img_in = state_of(flux), flux.model.diffusion_model.img_in.weight
    lora = REGISTRY["canny"]
    core = patched_state(flux, core_lora(flux, dict(lora), 1.0))
    ours, _, report = load_lora_for_models(flux, None, lora, 1.0, 0.0, mode="runtime")
    assert report.keys_applied == len(lora) and report.mode == "runtime"
    got = patched_state(flux, ours)
    assert got["img_in.weight"].shape == core["img_in.weight"].shape
    padded = torch.cat([original["img_in.weight"], torch.zeros_like(original["img_in.weight"])], dim=1)
    assert torch.equal(got["img_in.weight"], padded)  # zero columns: the LoRA runs as a path on top
    assert all(torch.equal(got[k], v) for k, v in original.items() if k != "img_in.weight")
    assert_original(flux, original, img_in)


@pytest.mark.parametrize("mode", ["merge", "runtime", "auto"])
def test_sampled_with_the_control_latent_equals_core(flux, mode):
    original, img_in = state_of(flux), flux.model.diffusion_model.img_in.weight
    executor = make_executor()  # one executor: the re-queue finds the grown model still loaded
    base = latent_of([])
    ours = latent_of([("canny", 0.8, mode)], executor)
    requeued = latent_of([("canny", 0.4, mode)], executor)
    unload_all(flux)
    core = latent_of([("canny", 0.8, "core")])
    core_requeued = latent_of([("canny", 0.4, "core")])
    assert (core - base).abs().max() > 100 * ATOL and (core - core_requeued).abs().max() > 100 * ATOL
    torch.testing.assert_close(ours, core, rtol=0, atol=ATOL)
    torch.testing.assert_close(requeued, core_requeued, rtol=0, atol=ATOL)
    unload_all(flux)
    assert_original(flux, original, img_in)


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_an_img_in_width_comfyui_does_not_feed_is_refused(flux, tmp_path, mode):
    import_comfy()
    original, img_in = state_of(flux), flux.model.diffusion_model.img_in.weight
    patches, uuid = dict(flux.patches), flux.patches_uuid
    path = tmp_path / "odd_control.safetensors"
    save_file(control_lora(flux, width_factor=1.5), str(path))  # 96 columns: 24 channels, no latent has that
    with pytest.raises(TargetError) as caught:
        load_lora_for_models(flux, None, str(path), 1.0, 0.0, mode=mode)
    message = str(caught.value)
    assert str(path) in message and "img_in.lora_A.weight" in message and "64 to 96" in message
    assert flux.patches == patches and flux.patches_uuid == uuid
    assert_original(flux, original, img_in)
