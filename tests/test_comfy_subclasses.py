"""ComfyUI model classes that subclass one we map (FluxInpaint is a Flux, SSD-1B an SDXL, HunyuanVideoI2V a
HunyuanVideo, WAN21_Vace a Wan) resolve through their base class's architecture. They used to map to nothing,
so a diffusers-named Flux Fill LoRA landed 0 keys on ComfyUI's FluxInpaint (core's LoraLoader lands it).

Reference: loraweave.apply on the diffusers twin (FluxTransformer2DModel with Fill's 384 input channels)
holding the same weights, mapped row by row through ComfyUI's own flux_to_diffusers; and core's merge, bit for
bit."""

from __future__ import annotations

import pytest
import torch
from helpers import comfy_checks as checks
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted, kohya, target_linears
from helpers.comfy_models import ComfyModel, flux_rows_map, flux_state_dict, flux_twin, rows_of

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def fill() -> ComfyModel:
    c = import_comfy()
    patcher = c.sd.load_diffusion_model_state_dict(
        dict(flux_state_dict(0, in_channels=96, out_channels=16)),
        model_options={"dtype": torch.float32},
        disable_dynamic=True,
    )
    assert type(patcher.model.model_config).__name__ == "FluxInpaint"
    return ComfyModel("flux-fill", patcher, None, flux_twin(patcher, in_channels=384, out_channels=64))


def _rows(m: ComfyModel):
    mapping = flux_rows_map(m.patcher)
    names = m.diffusers.state_dict()
    return lambda state: {n: rows_of(state, where) for n, where in mapping.items() if n in names}


def _file(m: ComfyModel, stem_of, peft: bool = False) -> dict[str, torch.Tensor]:
    modules = {**target_linears(m.diffusers), "x_embedder": m.diffusers.x_embedder}
    return adapter_file(modules, "lora", stem_of, peft=peft)


@pytest.mark.parametrize(
    "layout, stem_of, peft",
    [
        ("diffusers", dotted("transformer."), True),
        ("kohya", kohya("lora_transformer_"), False),
    ],
)
def test_flux_fill_lands_and_equals_the_twin(fill, layout, stem_of, peft):
    from loraweave.comfy.targets import comfy_arch

    assert comfy_arch(fill.patcher) == "flux"
    sd = _file(fill, stem_of, peft)
    assert any(k.startswith(("transformer.x_embedder", "lora_transformer_x_embedder")) for k in sd)
    model = checks.check_against_twin(_rows(fill), fill, sd)  # x_embedder's 384 inputs included
    # ComfyUI's own LoraLoader maps diffusers-named Flux keys onto any Flux subclass: bit-identical to ours
    assert checks.comfy_core_verdict(_rows(fill), fill, model, sd) == "identical"


def test_subclasses_map_to_their_nearest_mapped_base():
    import_comfy()
    import comfy.supported_models as sm

    from loraweave.comfy.targets import COMFY_ARCHS, comfy_arch

    class Holder:  # what comfy_arch reads: patcher.model.model_config
        def __init__(self, cls):
            self.model = type("M", (), {"model_config": cls.__new__(cls)})()

    expected = {
        "FluxInpaint": "flux",
        "SSD1B": "sdxl",
        "KOALA_700M": "sdxl",
        "HunyuanVideoI2V": "hunyuan-video",
        "HunyuanVideoSkyreelsI2V": "hunyuan-video",
        "WAN21_Vace": "wan",
        "WAN21_FunControl2V": "wan",
        "SD15_instructpix2pix": "sd1",
    }
    for name, arch in expected.items():
        assert name not in COMFY_ARCHS, name  # mapped through the base class, not by its own row
        assert comfy_arch(Holder(getattr(sm, name))) == arch, name
    # a class mapped by name keeps its own row (HunyuanVideo15_SR_Distilled is no HunyuanVideo)
    assert comfy_arch(Holder(sm.WAN22_Animate)) == "wan-animate"
    assert comfy_arch(Holder(sm.StableAudio)) is None
