"""loraweave.comfy on every architecture with ComfyUI facets, by the names adapter files use: a tiny model per
case (helpers.comfy_arch_cases, built the way ComfyUI loads it) resolves on the registry record's reference
tree at the model's widths, and files in each trainer layout (kohya on the twin's or ComfyUI's names,
`transformer.`, PEFT, the trainers' own spellings) land equal to `loraweave.apply` on the diffusers twin
within 1e-6 relative per weight, next to ComfyUI core's measured verdict on the same file."""

from __future__ import annotations

import pytest
from helpers.comfy_arch_cases import CASES, built_case, check_fp64, layout_file, split_original_file
from helpers.comfy_checks import (
    all_linears,
    check_against_twin,
    check_reference_tree,
    comfy_core_verdict,
    comfy_modules,
)
from helpers.comfy_dits import tencent_name
from helpers.comfy_dits2 import VARIANT_BUILDERS
from helpers.comfy_files import adapter_file, dotted, kohya

from loraweave.arch import registry
from loraweave.comfy.targets import comfy_arch


def _cases(families_of) -> list:
    return [
        pytest.param(name, family, id=f"{name}-{family}")
        for name, case in CASES.items()
        for family in families_of(case)
    ]


@pytest.fixture(scope="module")
def models():
    return {}


def built(models, name: str):
    return built_case(models, name)


def check_layout(models, name: str, layout: str, family: str) -> None:
    """A `family` file in `layout` lands as on the twin; on a LoRA, ComfyUI core's verdict is the measured
    one."""
    m, case = built(models, name), CASES[name]
    sd = layout_file(m, layout, family)
    model = check_against_twin(case.row_map(m), m, sd)
    if family == "lora" and layout in case.verdicts:
        assert comfy_core_verdict(case.row_map(m), m, model, sd) == case.verdicts[layout]


def test_the_cases_cover_every_record_with_comfy_facets():
    # sd1, sd2, sdxl, sdxl-refiner, flux and flux-schnell: test_comfy_weights.py and test_comfy_skeletons.py.
    elsewhere = {"sd1", "sd2", "sdxl", "sdxl-refiner", "flux", "flux-schnell"}
    with_facets = {a.name for a in registry.ARCHITECTURES if a.comfy is not None}
    covered = {c.arch for c in CASES.values()} - {None}
    assert covered <= with_facets, covered - with_facets
    assert with_facets == covered | elsewhere, with_facets ^ (covered | elsewhere)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.arch is not None])
def test_reference_tree_at_model_widths(models, name, caplog):
    # Keys resolve on the diffusers tree at the tiny model's widths (the record's ComfyUI facets read
    # ComfyUI's unet_config), not on the fallback of ComfyUI's own names that a fits=no WARNING announces.
    m = built(models, name)
    assert comfy_arch(m.patcher) == CASES[name].arch
    check_reference_tree(m, caplog)


def test_hidream_keeps_the_diffusers_names(models):
    # ComfyUI's HiDream is diffusers' module for module (diffusers' converter only strips the prefix): keys
    # resolve on ComfyUI's own modules, with no reference tree (loraweave's catalog has no HiDream skeleton).
    from loraweave.comfy.targets import reference_tree

    m = built(models, "hidream")
    assert CASES["hidream"].arch is None and reference_tree(m.patcher) is None
    ours = {k: tuple(v.shape) for k, v in comfy_modules(m).state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in m.diffusers.state_dict().items()}


@pytest.mark.parametrize(("name", "family"), _cases(lambda c: c.kohya_diffusers))
def test_kohya_on_diffusers_names(models, name, family):
    check_layout(models, name, "kohya-diffusers", family)


@pytest.mark.parametrize(("name", "family"), _cases(lambda c: c.kohya_comfy))
def test_kohya_on_comfy_names(models, name, family):
    # ComfyUI's own (original) module names: fused rows land per range on the twin's split modules.
    check_layout(models, name, "comfy", family)


@pytest.mark.parametrize(("name", "family"), _cases(lambda c: c.dotted))
def test_diffusers_layout(models, name, family):
    check_layout(models, name, "diffusers", family)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.peft])
def test_peft_diffusers_layout(models, name):
    check_layout(models, name, "peft", "lora")


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.every_linear])
def test_every_linear_lands(models, name):
    # Every Linear of the model, embedders, modulation, refiners and final layers included, in ComfyUI's
    # `diffusion_model.` layout (where the case says so, also against the fp64 formula on the weight of the
    # same name, independent of any row map) and in kohya's on diffusers names. Anima's LLM adapter is no
    # module of the diffusers transformer: test_comfy_arch_weights.py.
    m, case = built(models, name), CASES[name]
    comfy = {n: mod for n, mod in all_linears(comfy_modules(m)).items() if not n.startswith("llm_adapter.")}
    sd = adapter_file(comfy, "lora", dotted("diffusion_model."))
    model = check_against_twin(case.row_map(m), m, sd)
    if case.every_linear_fp64:
        check_fp64(m, sd, lambda stem: (stem.removeprefix("diffusion_model."), 0), model)
    check_against_twin(
        case.row_map(m), m, adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_"))
    )


def test_hunyuan_video_tencent_names(models):
    # musubi-tuner / diffusion-pipe files name HunyuanVideo's modules as the original checkpoint does
    # (`img_attn_qkv`, `img_mod.linear`, `mlp.fc1`), which ComfyUI renames on load.
    m = built(models, "hunyuan-video")
    linears = {tencent_name(n): mod for n, mod in all_linears(comfy_modules(m)).items()}
    assert any("img_attn_qkv" in n for n in linears) and any("mlp.fc1" in n for n in linears)
    check_against_twin(m.as_diffusers, m, adapter_file(linears, "lora", kohya("lora_unet_")))


@pytest.mark.parametrize("name", ["hunyuan-video-1.5", "hunyuan-image-2.1"])
def test_hunyuan_trainer_split_names(models, name):
    # musubi-tuner and sd-scripts split every double-block qkv, the official HunyuanImage code the single
    # blocks' linear1: the split q / k / v land on thirds of ComfyUI's fused qkv (checked in fp64 on ComfyUI's
    # tensors).
    m = built(models, name)
    sd, where = split_original_file(m)
    assert any("img_attn_q." in k for k in sd) and any("mlp_fc1" in k for k in sd)
    assert name == "hunyuan-video-1.5" or any("linear1_mlp" in k for k in sd)
    model = check_against_twin(m.as_diffusers, m, sd)
    check_fp64(m, sd, where.__getitem__, model)
    assert comfy_core_verdict(m.as_diffusers, m, model, sd) == "drops"


@pytest.mark.parametrize("name", list(VARIANT_BUILDERS))
def test_sibling_releases_map_to_their_tables(name, caplog):
    # ComfyUI's own supported_models classes for HunyuanVideo 1.5's SR model and HunyuanImage 2.1's refiner
    # reach the same tables: a reference tree at the model's widths, and every Linear lands in both layouts.
    m = VARIANT_BUILDERS[name]()
    check_reference_tree(m, caplog)
    sd = adapter_file(all_linears(comfy_modules(m)), "lora", dotted("diffusion_model."))
    model = check_against_twin(m.as_diffusers, m, sd)
    check_fp64(m, sd, lambda stem: (stem.removeprefix("diffusion_model."), 0), model)
    check_against_twin(m.as_diffusers, m, adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_")))
