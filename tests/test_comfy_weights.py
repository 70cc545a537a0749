"""loraweave.comfy merges (ComfyUI's patch list, `patch_weight_to_device(..., return_weight=True)`) against
references: `loraweave.apply` on the diffusers twin holding the same weights, mapped row by row through
diffusers' single-file converter (SD UNets) or ComfyUI's flux_to_diffusers rows (Flux; diffusers' converter is
fixed at width 3072), within 1e-6 relative; and bit-identical to ComfyUI's own LoraLoader wherever that one is
right."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers.comfy_env import COMFYUI_TREE, import_comfy
from helpers.comfy_files import (
    FAMILIES,
    adapter_file,
    conv_lora,
    dotted,
    kohya,
    processor_unet,
    target_linears,
    xlabs_flux,
)
from helpers.comfy_models import BUILDERS, flux_rows_map, rows_of

import loraweave
from loraweave.comfy import load_lora_for_models

TOL = 1e-6  # relative, on each weight: fp32 through two independent row maps
STRENGTH_MODEL, STRENGTH_CLIP = 0.7, 0.5


@pytest.fixture(scope="module")
def models():
    return {name: build() for name, build in BUILDERS.items()}


def merged_state(patcher) -> dict[str, torch.Tensor]:
    """Every weight of the patcher's diffusion model as ComfyUI's merge writes it (unpatched ones as they
    are)."""
    state = {k: v.detach().clone() for k, v in patcher.model.state_dict().items()}
    for key in patcher.patches:
        state[key] = patcher.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
    return {
        k.removeprefix("diffusion_model."): v for k, v in state.items() if k.startswith("diffusion_model.")
    }


def as_diffusers(m, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ComfyUI diffusion-model state in the twin's names, through the row maps the module docstring
    names."""
    if m.name == "flux":
        return {
            k: rows_of(state, where)
            for k, where in flux_rows_map(m.patcher).items()
            if k in m.diffusers.state_dict()
        }
    from diffusers.loaders.single_file_utils import (
        convert_ldm_unet_checkpoint,
        convert_wan_transformer_to_diffusers,
    )

    if m.name == "wan":
        return convert_wan_transformer_to_diffusers(dict(state))
    ldm = {f"model.diffusion_model.{k}": v for k, v in state.items()}
    return convert_ldm_unet_checkpoint(ldm, dict(m.diffusers.config))


def reference(m, sd: dict) -> dict[str, torch.Tensor]:
    twin = copy.deepcopy(m.diffusers)
    loraweave.apply(twin, sd, mode="merge", strength=STRENGTH_MODEL)
    return twin.state_dict()


def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def check_against_twin(m, sd: dict, changed_at_least: int):
    """Merge `sd` through loraweave.comfy; every twin weight within TOL of loraweave.apply's; returns the
    patcher."""
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    ours = as_diffusers(m, merged_state(model))
    ref = reference(m, sd)
    base = m.diffusers.state_dict()
    assert ours.keys() == ref.keys()
    errors = {k: rel(ours[k], ref[k]) for k in ref}
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])
    changed = [k for k in ref if not torch.equal(ref[k], base[k])]
    assert len(changed) >= changed_at_least, "the file changed too little: the check would prove nothing"
    return model


def check_comfy_core(m, model, sd: dict) -> int:
    """Where ComfyUI's LoraLoader lands every key within TOL of the twin reference, ours is bit-identical to
    it. Returns how many weights that held for (0 when ComfyUI is wrong or drops the file)."""
    core, _ = import_comfy().sd.load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0)
    if set(core.patches) != set(model.patches):
        return 0
    core_state = merged_state(core)
    ref = reference(m, sd)
    core_diffusers = as_diffusers(m, core_state)
    if max(rel(core_diffusers[k], ref[k]) for k in ref) > TOL:
        return 0
    ours = merged_state(model)
    for key in model.patches:
        short = key.removeprefix("diffusion_model.")
        assert torch.equal(ours[short], core_state[short]), key
    return len(model.patches)


def comfy_names(m) -> dict[str, torch.nn.Module]:
    return target_linears(m.patcher.model.diffusion_model)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_kohya_on_diffusers_names(models, name, family):
    m = models[name]
    sd = adapter_file(
        target_linears(m.diffusers), family, kohya("lora_unet_" if name != "flux" else "lora_transformer_")
    )
    model = check_against_twin(m, sd, changed_at_least=8)
    if family == "lora":
        assert check_comfy_core(m, model, sd) > 0, (
            "ComfyUI lands kohya LoRA right: ours must equal it bit for bit"
        )
    if family == "dora":  # ComfyUI loads every DoRA key but is off at strength != 1 (issue 29); ours is not
        core, _ = import_comfy().sd.load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0)
        assert set(core.patches) == set(model.patches)
        core_diffusers, ref = as_diffusers(m, merged_state(core)), reference(m, sd)
        assert max(rel(core_diffusers[k], ref[k]) for k in ref) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_original_names(models, name, family):
    # kohya on ldm/BFL names (ComfyUI's own module names): fused qkv and linear1 rows split by the offsets.
    m = models[name]
    sd = adapter_file(comfy_names(m), family, kohya("lora_unet_"))
    model = check_against_twin(m, sd, changed_at_least=8)
    if family == "lora":
        assert check_comfy_core(m, model, sd) > 0


@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_diffusers_and_comfy_spelled_lora(models, name):
    # `unet.`/`transformer.` + lora_A/lora_B (diffusers), `diffusion_model.` + original names (ComfyUI's own).
    m = models[name]
    prefix = "transformer." if name == "flux" else "unet."
    for stem_of, modules in (
        (dotted(prefix), target_linears(m.diffusers)),
        (dotted("diffusion_model."), comfy_names(m)),
    ):
        sd = adapter_file(modules, "lora", stem_of, peft=True)
        check_comfy_core(m, check_against_twin(m, sd, changed_at_least=8), sd)
    if (
        name != "flux"
    ):  # attention-processor keys: ComfyUI maps them, so ours must equal its merge bit for bit
        sd = processor_unet(m.diffusers, legacy_layer=False)
        assert check_comfy_core(m, check_against_twin(m, sd, changed_at_least=4), sd) > 0


def dropped_files(m) -> dict[str, dict]:
    if m.name == "flux":
        peft = adapter_file(target_linears(m.diffusers), "lora", dotted("base_model.model."), peft=True)
        return {"xlabs": xlabs_flux(m.diffusers), "peft base_model.model.": peft}
    return {"lora.down": processor_unet(m.diffusers, legacy_layer=True)}


@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_layouts_comfy_drops_land(models, name):
    m = models[name]
    for layout, sd in dropped_files(m).items():
        core, _ = import_comfy().sd.load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0)
        assert not core.patches, f"{layout}: ComfyUI {COMFYUI_TREE} loads it now; the test shows no gap"
        check_against_twin(m, sd, changed_at_least=4)


ENCODERS = {  # ComfyUI CLIP attribute -> (kohya prefix, loraweave component), per model
    "sd15": (("clip_l", "lora_te1_", "text_encoder"),),
    "sdxl": (("clip_l", "lora_te1_", "text_encoder"), ("clip_g", "lora_te2_", "text_encoder_2")),
    "flux": (("clip_l", "lora_te1_", "text_encoder"), ("t5xxl", "lora_te2_", "text_encoder_2")),
}


@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_text_encoder_keys_match_comfy_and_loraweave(models, name):
    m = models[name]
    sd, refs, prefixes = {}, {}, {}
    for attr, kohya_prefix, component in ENCODERS[name]:
        encoder = getattr(m.clip.cond_stage_model, attr).transformer
        linears = {n: x for n, x in encoder.named_modules() if isinstance(x, torch.nn.Linear)}
        sd.update(adapter_file(linears, "lora", kohya(kohya_prefix), seed=9))
        refs[component], prefixes[f"{attr}.transformer."] = copy.deepcopy(encoder), component
    model, clip, report = load_lora_for_models(
        m.patcher, m.clip, sd, STRENGTH_MODEL, STRENGTH_CLIP, mode="merge"
    )
    assert report.keys_applied == report.keys_total == len(sd)
    _, core_clip = import_comfy().sd.load_lora_for_models(
        m.patcher, m.clip, sd, STRENGTH_MODEL, STRENGTH_CLIP
    )
    loraweave.apply(refs, sd, mode="merge", strength=STRENGTH_CLIP)
    assert len(clip.patcher.patches) == len(sd) // 3  # down, up, alpha per module: every module patched
    for key in clip.patcher.patches:
        ours = clip.patcher.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
        prefix = next(p for p in prefixes if key.startswith(p))
        assert rel(ours, refs[prefixes[prefix]].state_dict()[key.removeprefix(prefix)]) <= TOL, key
        if key in core_clip.patcher.patches:  # where ComfyUI maps the key it is right: bit for bit
            core = core_clip.patcher.patch_weight_to_device(
                key, device_to=torch.device("cpu"), return_weight=True
            )
            assert torch.equal(ours, core), key
    assert core_clip.patcher.patches, "ComfyUI maps kohya text-encoder keys: the bitwise check must run"


def test_inputs_are_never_modified(models):
    m = models["flux"]
    before_uuid, before_patches = m.patcher.patches_uuid, dict(m.patcher.patches)
    clip_uuid = m.clip.patcher.patches_uuid
    weights = {k: v.clone() for k, v in m.patcher.model.state_dict().items()}
    sd = adapter_file(comfy_names(m), "lora", kohya("lora_unet_"))
    model, clip, _ = load_lora_for_models(m.patcher, m.clip, sd, 1.0, 1.0)
    merged_state(model)
    assert model is not m.patcher and clip is not m.clip and model.patches
    assert m.patcher.patches_uuid == before_uuid and m.patcher.patches == before_patches
    assert m.clip.patcher.patches_uuid == clip_uuid and not m.clip.patcher.patches
    for k, v in m.patcher.model.state_dict().items():
        assert torch.equal(v, weights[k]), k


@pytest.mark.parametrize("family", ["lora", "lokr", "dora"])
def test_wan_kohya_and_original(models, family):
    # ComfyUI maps no diffusers-named kohya Wan key (lora_transformer_blocks_0_attn1_to_q): it drops
    # them.
    m = models["wan"]
    sd = adapter_file(target_linears(m.diffusers), family, kohya("lora_transformer_"))
    if family == "lora":
        core, _ = import_comfy().sd.load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0)
        assert not core.patches
    check_against_twin(m, sd, changed_at_least=8)
    model = check_against_twin(
        m, adapter_file(comfy_names(m), family, dotted("diffusion_model."), peft=family == "lora"), 8
    )
    if family == "lora":
        assert (
            check_comfy_core(
                m, model, adapter_file(comfy_names(m), "lora", dotted("diffusion_model."), peft=True)
            )
            > 0
        )


def test_wan_modulation_lands_where_comfy_skips_it(models):
    """Wan's `blocks.N.modulation` sits on a module with children: ComfyUI accepts a patch for it and never
    applies it. Ours lands (an object patch), equals loraweave.apply on the twin's scale_shift_table, and
    unpatches."""
    m = models["wan"]
    g = torch.Generator().manual_seed(11)
    delta = torch.randn(1, 6, 128, generator=g) * 0.01
    key = "diffusion_model.blocks.0.modulation"
    base = m.patcher.get_model_object(key).detach().clone()
    core = m.patcher.clone()
    assert key in core.add_patches({key: ("diff", (delta,))}, 1.0)
    core.patch_model()
    assert torch.equal(core.get_model_object(key), base), (
        "ComfyUI applies it now: the object patch is not needed"
    )
    core.unpatch_model()
    sd = {f"{key}.diff": delta}
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0, mode="merge")
    assert report.keys_applied == 1 and report.applied[0].notes
    twin = copy.deepcopy(m.diffusers)
    loraweave.apply(twin, sd, mode="merge", strength=STRENGTH_MODEL)
    model.patch_model()
    try:
        landed = model.model.diffusion_model.blocks[0].modulation.detach().clone()
    finally:
        model.unpatch_model()
    assert rel(landed, twin.blocks[0].scale_shift_table.detach()) <= TOL and not torch.equal(landed, base)
    assert torch.equal(m.patcher.model.diffusion_model.blocks[0].modulation, base)


def test_lowvram_dtype_and_function_paths(models):
    """The same patch as ComfyUI's lowvram/DynamicVRAM casts run it: on a bf16 weight with a bf16 intermediate
    (within bf16 rounding of the fp32 merge), and with a patch function, which applies to ΔW (here:
    negated)."""
    c = import_comfy()
    m = models["flux"]
    sd = adapter_file(comfy_names(m), "dora", kohya("lora_unet_"))
    model, _, _ = load_lora_for_models(m.patcher, None, sd, STRENGTH_MODEL, 0.0, mode="merge")
    key = "diffusion_model.single_blocks.0.linear1.weight"
    base = m.patcher.get_model_object(key).detach()
    merged = model.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
    low = c.lora.calculate_weight(
        model.patches[key], base.to(torch.bfloat16), key, intermediate_dtype=torch.bfloat16
    )
    assert low.dtype == torch.bfloat16
    assert (low.float() - merged).abs().max() <= 2 * 2**-8 * merged.abs().max()
    negated = [(s, v, sm, off, lambda d: -d) for s, v, sm, off, _ in model.patches[key]]
    flipped = c.lora.calculate_weight(negated, base.clone(), key)
    assert rel(flipped, 2 * base - merged) <= TOL and not torch.equal(merged, base)


def test_auto_mode_merges_float_bases_and_runs_quantized_ones_at_runtime(models):
    from loraweave.comfy.api import choose_mode

    m = models["sd15"]
    assert choose_mode(m.patcher, "auto") == "merge"
    # What choose_mode reads of a MODEL: its diffusion model's parameters; one fp8 layer makes it a quantized
    # base.
    fp8 = torch.nn.Linear(4, 4)
    fp8.weight = torch.nn.Parameter(fp8.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    quantized = SimpleNamespace(
        model=SimpleNamespace(diffusion_model=torch.nn.Sequential(torch.nn.Linear(4, 4), fp8))
    )
    assert choose_mode(quantized, "auto") == "runtime" and choose_mode(quantized, "merge") == "merge"


@pytest.mark.parametrize("name", ["sd15", "sdxl"])
def test_locon_on_every_conv(models, name):
    # Conv weights (resnets 3x3, SD1.5's 1x1 proj_in/out, up/down samplers): ΔW reshaped over (out, in·k·k).
    m = models[name]
    sd = conv_lora(m.diffusers, "lora_unet_")
    assert check_comfy_core(m, check_against_twin(m, sd, changed_at_least=10), sd) > 0
