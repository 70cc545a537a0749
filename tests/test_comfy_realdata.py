"""Real adapter files (../shared/realdata/lora) planned by loraweave.comfy onto full-size ComfyUI models built
on `meta` (SD1.5 UNet + CLIP-L, SD2, Flux.1-dev): every key lands, where ComfyUI's own key maps load
some files only in part or not at all (cloneofsimo, diffusers `unet.X.lora.down`)."""

from __future__ import annotations

import pytest
from helpers.comfy_env import import_comfy
from helpers.comfy_full import FLUX_DEV, META, SD2_UNET, SD15_UNET, meta_patcher
from safetensors.torch import load_file

from loraweave.comfy.targets import plan_for_clip, plan_for_patcher
from loraweave.formats.adapter import load_adapter

# file -> whether ComfyUI's own key map loads none of it (the gap the pack closes)
SD1_FILES = {
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors": False,
    "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr.safetensors": False,
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors": False,
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors": False,
    "cloneofsimo__lora__analog_svd_rank4.safetensors": True,
    "timohavdk__sd-lora__2100-lora.safetensors": True,
}


@pytest.fixture(scope="module")
def sd15():
    c = import_comfy()
    import comfy.sd1_clip
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    clip = c.sd.CLIP(target, model_options={"initial_device": META}, disable_dynamic=True)
    return meta_patcher(c.supported_models.SD15, SD15_UNET), clip


def landed(plans) -> int:
    return sum(len(pp.part.keys) for plan in plans for pp in (*plan.planned, *plan.params))


def core_targets(model, clip, sd: dict) -> int:
    """How many modules ComfyUI's own LoraLoader mapping (model_lora_keys_unet/clip + load_lora) would
    patch."""
    c = import_comfy()
    key_map = c.lora.model_lora_keys_unet(model.model, {})
    if clip is not None:
        key_map = c.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
    return len(c.lora.load_lora(c.lora_convert.convert_lora(sd), key_map, log_missing=False))


@pytest.mark.parametrize("name", sorted(SD1_FILES))
def test_real_sd1_files_land_on_comfy_sd15(realdata, sd15, name):
    model, clip = sd15
    path = realdata / "lora" / name
    adapter = load_adapter(path)
    plans = (plan_for_patcher(model, adapter), plan_for_clip(clip, adapter))
    assert not [u for plan in plans for u in plan.unmatched], [u.reason for p in plans for u in p.unmatched][
        :3
    ]
    assert landed(plans) == adapter.keys_total
    core = core_targets(model, clip, load_file(str(path)))
    assert (core == 0) == SD1_FILES[name], f"ComfyUI maps {core} targets of {name}"


def test_real_flux_file_lands_on_comfy_flux_dev(realdata):
    model = meta_patcher(import_comfy().supported_models.Flux, FLUX_DEV)
    adapter = load_adapter(realdata / "lora" / "leighwoods__public-loras__lora.safetensors")
    plan = plan_for_patcher(model, adapter)
    assert not plan.unmatched and landed([plan]) == adapter.keys_total


def test_real_sd2_lora_down_file_lands_on_comfy_sd2(realdata):
    c = import_comfy()
    model = meta_patcher(c.supported_models.SD20, SD2_UNET)
    path = realdata / "lora" / "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"
    adapter = load_adapter(path)
    plan = plan_for_patcher(model, adapter)
    assert not plan.unmatched and landed([plan]) == adapter.keys_total
    assert (
        core_targets(model, None, load_file(str(path))) == 0
    )  # diffusers `unet.X.lora.down`: ComfyUI drops it
