"""A BFL Flux control LoRA (`img_in` trained on latents + one control latent: 128 columns) on ComfyUI models
whose img_in is not fed that: Flux Fill (ComfyUI's FluxInpaint, in_channels 96 -> img_in 384: latents,
masked-image latents, mask) and Chroma (img_in 64, and no control input: its concat_cond compares img_in's
channels per patch with out_channels counted after patching, so it never concatenates a control latent).

Checked through `loraweave.comfy.load_lora_for_models` in every mode, strict or not, and through ComfyUI's
own executor with the pack's loader: refused with OtherInputError naming the file and its img_in keys, the
input model untouched (patch list, its uuid, every weight bit for bit, img_in on its own storage). Core
ComfyUI does not run the file on either: on Fill its reshape_weight fails while patching, on Chroma it widens
img_in and sampling fails on the 64-column input (checked here, so a ComfyUI that starts feeding Chroma a
control latent shows up)."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_control import control_conditioning, control_lora
from helpers.comfy_dits import tiny_chroma
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    REGISTRY,
    core_lora,
    flux_fixture,
    register_test_nodes,
    tiny_flux_patcher,
    unload_all,
)
from safetensors.torch import save_file

from loraweave.comfy.api import load_lora_for_models
from loraweave.errors import OtherInputError

pytestmark = pytest.mark.usefixtures("one_thread")
CANNY = "canny_control.safetensors"
IMG_IN_KEYS = ("img_in.lora_A.weight", "img_in.lora_B.weight", "img_in.lora_B.bias")


@pytest.fixture(scope="module")
def fill():
    """ComfyUI's own Flux Fill at the tiny Flux's hidden width: detection from img_in's 384 columns."""
    patcher = tiny_flux_patcher(in_channels=96, out_channels=16)
    assert type(patcher.model.model_config).__name__ == "FluxInpaint"
    assert tuple(patcher.model.diffusion_model.img_in.weight.shape) == (128, 384)
    return patcher


@pytest.fixture(scope="module")
def chroma():
    patcher = tiny_chroma().patcher
    assert type(patcher.model).__name__ == "Chroma"
    assert tuple(patcher.model.diffusion_model.img_in.weight.shape) == (128, 64)
    return patcher


@pytest.fixture(scope="module")
def canny(flux, tmp_path_factory):
    """The control LoRA of the tiny Flux (img_in 64 -> 128 columns), as a file."""
    path = tmp_path_factory.mktemp("canny") / CANNY
    save_file(control_lora(flux), str(path))
    return path


def snapshot(patcher) -> dict:
    model = patcher.model.diffusion_model
    return {
        "patches": dict(patcher.patches),
        "uuid": patcher.patches_uuid,
        "img_in": model.img_in.weight.data_ptr(),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def assert_untouched(patcher, before: dict) -> None:
    now = snapshot(patcher)
    assert now["patches"] == before["patches"] and now["uuid"] == before["uuid"]
    assert now["img_in"] == before["img_in"] and now["state"].keys() == before["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(now["state"][key], value), key


def refused(patcher, path, **kwargs) -> str:
    before = snapshot(patcher)
    with pytest.raises(OtherInputError) as caught:
        load_lora_for_models(patcher, None, str(path), 1.0, 0.0, **kwargs)
    assert_untouched(patcher, before)
    message = str(caught.value)
    assert str(path) in message and all(key in message for key in IMG_IN_KEYS), message
    return message


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", ["merge", "runtime", "auto"])
def test_control_lora_on_flux_fill_is_refused(fill, canny, mode, strict):
    message = refused(fill, canny, mode=mode, strict=strict)
    assert "trained on 128 input columns" in message and "takes 384" in message, message


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_control_lora_on_chroma_is_refused(chroma, canny, mode, strict):
    message = refused(chroma, canny, mode=mode, strict=strict)
    assert "from 64 to 128" in message and "it takes no control input" in message, message


@pytest.mark.parametrize("model", ["fill", "chroma"])
def test_the_loader_node_refuses_it_through_comfyuis_executor(comfy_home, canny, model, request, monkeypatch):
    patcher = request.getfixturevalue(model)
    register_test_nodes(monkeypatch)
    monkeypatch.setitem(REGISTRY, model, patcher)
    (comfy_home["base"] / "models" / "loras" / CANNY).write_bytes(canny.read_bytes())
    before = snapshot(patcher)
    prompt = {
        "1": {"class_type": "LWTestModelSource", "inputs": {"name": model}},
        "2": {
            "class_type": "LoraWeaveLoaderModelOnly",
            "inputs": {
                "model": ["1", 0],
                "lora_name": CANNY,
                "strength_model": 1.0,
                "mode": "auto",
                "strict": False,
            },
        },
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
    }
    valid, errors, ex, _ = run_prompt(prompt)
    assert valid and not ex.success, errors
    failure = execution_error(ex)
    assert failure["node_id"] == "2" and failure["exception_type"] == "loraweave.errors.OtherInputError"
    assert CANNY in failure["exception_message"] and IMG_IN_KEYS[0] in failure["exception_message"]
    assert_untouched(patcher, before)


def test_core_does_not_run_it_either(fill, chroma, flux):
    """Why refusing matches core: on Fill its reshape_weight cannot narrow 384 columns to 128; on Chroma it
    widens img_in (the file's Flux-only modulation keys are not loaded) and sampling then feeds img_in the
    64-column latents alone."""
    import nodes

    lora = control_lora(flux)
    with pytest.raises(ValueError, match="new shape must be larger"):
        core_lora(fill, dict(lora), 1.0).patch_model()
    unload_all(fill)
    widened = core_lora(chroma, dict(lora), 1.0)
    widened.patch_model()
    assert tuple(widened.model.diffusion_model.img_in.weight.shape) == (128, 128)
    widened.unpatch_model()
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        nodes.KSampler().sample(
            widened,
            3,
            2,
            1.0,
            "euler",
            "simple",
            control_conditioning(1),
            control_conditioning(2),
            {"samples": torch.zeros(1, 16, 2, 2)},
            1.0,
        )
    unload_all(widened, chroma)
