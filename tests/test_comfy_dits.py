"""loraweave.comfy on SD3, Flux.2, Chroma, HunyuanVideo, LTX-2 and Lumina 2, each a tiny model built the way ComfyUI loads it
(helpers.comfy_dits: an original-named state dict through ComfyUI's detection and renames). References:
- merge: `loraweave.apply` on the diffusers twin (diffusers' single-file converter of the same weights), ComfyUI's
  merged weights mapped back through ComfyUI's renames and that converter (1e-6 relative per weight);
- ComfyUI's own LoraLoader: bit-identical wherever it lands the same keys within that tolerance;
- runtime: the model's forward with mode="runtime" within 1e-5 (absolute, outputs of magnitude ~1) of the merge.
Fused rows exercised: SD3 joint qkv (and SD3.5's attn2), Flux.2's fused qkv / SwiGLU `linear1` (one module on both
sides), Chroma's and HunyuanVideo's qkv and single-block linear1 (q | k | v | mlp), HunyuanVideo's refiner qkv,
Lumina 2's grouped-query qkv (q | k | v of unequal widths); LoRA, LoKr, LoHa, and the families whose ΔW reads the
weight (DoRA on both magnitude axes, OFT, BOFT) on those slices;
final-layer (shift, scale) halves swapped against diffusers' (scale, shift)."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_checks import (
    FORWARD_ATOL,
    STRENGTH,
    TOL,
    all_linears,
    block_linears,
    built_once,
    check_against_twin,
    check_reference_tree,
    comfy_core_verdict,
    comfy_modules,
    merged_state,
    rel,
    runtime_and_merge,
    twin_reference,
)
from helpers.comfy_dits import DIT_BUILDERS, DitModel, tencent_name
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted, kohya

from loraweave.comfy import load_lora_for_models
from loraweave.errors import NoKeysLandedError

NAMES = list(DIT_BUILDERS)
FAMILIES = ("lora", "lokr", "loha")
# W-dependent families: their ΔW reads the weight's own rows, so on a fused qkv / linear1 slice (ComfyUI narrows
# the weight by the patch's offset) the DoRA norm and the OFT / BOFT rotations must see exactly the twin module's
# rows. "dora_in": the magnitude on the input axis (LyCORIS wd_on_out=False), a norm over every row of the module.
WEIGHT_FAMILIES = ("dora", "oft", "boft")


def _forward_sd3(dm):
    g = torch.Generator().manual_seed(1)
    x, ctx, y = (torch.randn(s, generator=g) for s in ((1, 16, 4, 4), (1, 5, 32), (1, 32)))
    return dm(x, torch.tensor([0.5]), ctx, y=y)


def _forward_flux2(dm):
    g = torch.Generator().manual_seed(1)
    x, ctx = (torch.randn(s, generator=g) for s in ((1, 128, 2, 2), (1, 5, 32)))
    return dm(x, torch.tensor([0.5]), ctx, guidance=torch.tensor([3.0]))


def _forward_chroma(dm):
    g = torch.Generator().manual_seed(1)
    x, ctx = (torch.randn(s, generator=g) for s in ((1, 16, 4, 4), (1, 5, 32)))
    return dm(x, torch.tensor([0.5]), ctx, torch.tensor([0.0]))


def _forward_hunyuan(dm):
    g = torch.Generator().manual_seed(1)
    x, ctx, y = (torch.randn(s, generator=g) for s in ((1, 16, 1, 4, 4), (1, 5, 32), (1, 768)))
    return dm(x, torch.tensor([0.5]), ctx, y=y, guidance=torch.tensor([3.0]))


def _forward_ltx2(dm):
    # Video and audio latents (8 channels x 16 mel bins) in, both out; the text context is the two processed halves.
    g = torch.Generator().manual_seed(1)
    v, a, ctx = (torch.randn(s, generator=g) for s in ((1, 16, 1, 2, 2), (1, 8, 4, 16), (1, 5, 64)))
    return torch.cat([o.flatten() for o in dm([v, a], torch.tensor([0.5]), ctx)])


def _forward_lumina2(dm):
    g = torch.Generator().manual_seed(1)
    x, ctx = (torch.randn(s, generator=g) for s in ((1, 16, 4, 4), (1, 5, 32)))
    return dm(x, torch.tensor([0.5]), ctx, 5)


FORWARDS = {
    "sd3": _forward_sd3,
    "flux2": _forward_flux2,
    "chroma": _forward_chroma,
    "hunyuan-video": _forward_hunyuan,
    "ltx2": _forward_ltx2,
    "lumina2": _forward_lumina2,
}

# ComfyUI v0.19.3's own LoraLoader on a LoRA, by layout (measured): it maps each architecture's original names
# (kohya `lora_unet_` and `diffusion_model.`) and lands them bit for bit as ours; kohya on diffusers names it drops
# everywhere but LTX-2, whose diffusers names are its original ones but for a few renames.
CORE_VERDICTS = {
    **{(name, "diffusers"): "drops" for name in NAMES},
    **{(name, "comfy"): "identical" for name in NAMES},
    ("ltx2", "diffusers"): "identical",
}


@pytest.fixture(scope="module")
def models():
    return {}


def built(models, name: str) -> DitModel:
    return built_once(models, DIT_BUILDERS, name)


@pytest.mark.parametrize("name", NAMES)
def test_reference_tree_at_model_widths(models, name, caplog):
    # Keys resolve on the diffusers tree at the tiny model's widths (reference.py reads ComfyUI's unet_config) and
    # its spans name ComfyUI's own modules, not on the fallback that a fits=no WARNING announces.
    check_reference_tree(built(models, name), caplog)


@pytest.mark.parametrize("name", NAMES)
def test_kohya_on_diffusers_names(models, name):
    # LoKr / LoHa go through the same row maps: they run on ComfyUI's names below, where rows are fused.
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", kohya("lora_unet_"))
    model = check_against_twin(m.as_diffusers, m, sd)
    assert comfy_core_verdict(m.as_diffusers, m, model, sd) == CORE_VERDICTS[name, "diffusers"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", NAMES)
def test_kohya_on_comfy_names(models, name, family):
    # ComfyUI's own (original) module names: fused rows land per range on the twin's split modules.
    m = built(models, name)
    sd = adapter_file(block_linears(comfy_modules(m)), family, kohya("lora_unet_"))
    model = check_against_twin(m.as_diffusers, m, sd)
    if family == "lora":
        assert comfy_core_verdict(m.as_diffusers, m, model, sd) == CORE_VERDICTS[name, "comfy"]


# ComfyUI v0.19.3 on the W-dependent families at strength 0.7, by layout (measured): it drops the twin's names
# where it drops LoRA's (all but LTX-2), and where it loads a file it is off by more than 1e-6: its DoRA blends the
# strength outside the norm (issue 29: 0.57 ΔW at 0.5 against LyCORIS), its OFT and BOFT apply the strength twice
# (s·(R − I)·W scaled by s again). Ours is within 1e-6 of loraweave.apply on the twin in every cell.
WEIGHT_VERDICTS = {
    **{(name, family, "diffusers"): "drops" for name in NAMES for family in WEIGHT_FAMILIES},
    **{(name, family, "comfy"): "off" for name in NAMES for family in WEIGHT_FAMILIES},
    **{("ltx2", family, "diffusers"): "off" for family in WEIGHT_FAMILIES},
}


def weight_file(m: DitModel, family: str, layout: str) -> dict[str, torch.Tensor]:
    """A kohya `family` file on every block Linear, by the twin's names ("diffusers") or ComfyUI's ("comfy")."""
    modules = block_linears(m.diffusers if layout == "diffusers" else comfy_modules(m))
    if family != "dora_in":
        return adapter_file(modules, family, kohya("lora_unet_"))
    sd = adapter_file(modules, "lora", kohya("lora_unet_"))
    g = torch.Generator().manual_seed(13)
    for name, module in modules.items():
        sd[f"{kohya('lora_unet_')(name)}.dora_scale"] = 1.0 + 0.1 * torch.randn(
            1, module.weight.shape[1], generator=g
        )
    return sd


@pytest.mark.parametrize("layout", ["diffusers", "comfy"])
@pytest.mark.parametrize("family", WEIGHT_FAMILIES)
@pytest.mark.parametrize("name", NAMES)
def test_weight_dependent_families(models, name, family, layout):
    # On the twin's names a part lands on the rows of ComfyUI's fused module that the twin module holds (the
    # slice ComfyUI narrows); on ComfyUI's names a fused part is split per row range over the twin's modules.
    m = built(models, name)
    sd = weight_file(m, family, layout)
    model = check_against_twin(m.as_diffusers, m, sd)
    assert comfy_core_verdict(m.as_diffusers, m, model, sd) == WEIGHT_VERDICTS[name, family, layout]


def split_in_comfy(m: DitModel, sd: dict[str, torch.Tensor]) -> set[str]:
    """The stems of `sd` whose twin module ComfyUI holds as several row ranges (SD3's last context block and
    final layer: shift and scale halves swapped), read from our plan of the same stems as a plain LoRA."""
    from loraweave.comfy.api import read_lora
    from loraweave.comfy.targets import plan_for_patcher

    stems = {k.rsplit(".", 2)[0] for k in sd if k.endswith(".lora_down.weight")}
    lora = {k: v for k, v in sd.items() if not k.endswith(".dora_scale")}
    plan = plan_for_patcher(m.patcher, read_lora(lora))
    return {pp.part.keys[0].rsplit(".", 2)[0] for pp in plan.planned if len(pp.pieces) > 1} & stems


@pytest.mark.parametrize("name", NAMES)
def test_input_axis_dora_on_fused_slices(models, name):
    # The column norm runs over every row of the twin's module: on ComfyUI's fused qkv / linear1 that is the rows of
    # the slice ComfyUI hands over (q alone, k alone...), never the whole fused weight. A module ComfyUI holds in
    # several row ranges cannot give the norm range by range: refused and named, nothing patched there.
    m = built(models, name)
    sd = weight_file(m, "dora_in", "diffusers")
    split = split_in_comfy(m, sd)
    assert (name == "sd3") == bool(split), split  # SD3's swapped halves; the other models keep rows whole
    check_against_twin(m.as_diffusers, m, {k: v for k, v in sd.items() if k.rsplit(".", 2)[0] not in split})
    if split:
        refused = {k: v for k, v in sd.items() if k.rsplit(".", 2)[0] in split}
        with pytest.raises(NoKeysLandedError) as raised:  # nothing else in this file: no key lands
            load_lora_for_models(m.patcher, None, refused, STRENGTH, 0.0, mode="merge")
        report = raised.value.report
        assert {u.kind for u in report.unmatched} == {"unsupported"}, report.kinds()
        assert all("not row-local" in u.reason for u in report.unmatched)


@pytest.mark.parametrize("name", NAMES)
def test_peft_diffusers_layout(models, name):
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", dotted("transformer."), peft=True)
    check_against_twin(m.as_diffusers, m, sd)


@pytest.mark.parametrize("name", NAMES)
def test_every_linear_lands(models, name):
    # Every Linear of the model, embedders, modulation, refiners and final layers included, in ComfyUI's
    # `diffusion_model.` layout and in kohya's on diffusers names.
    m = built(models, name)
    for sd in (
        adapter_file(all_linears(comfy_modules(m)), "lora", dotted("diffusion_model.")),
        adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_")),
    ):
        check_against_twin(m.as_diffusers, m, sd)


def test_hunyuan_video_tencent_names(models):
    # musubi-tuner / diffusion-pipe files name HunyuanVideo's modules as the original checkpoint does
    # (`img_attn_qkv`, `img_mod.linear`, `mlp.fc1`), which ComfyUI renames on load.
    m = built(models, "hunyuan-video")
    linears = {tencent_name(n): mod for n, mod in all_linears(comfy_modules(m)).items()}
    assert any("img_attn_qkv" in n for n in linears) and any("mlp.fc1" in n for n in linears)
    check_against_twin(m.as_diffusers, m, adapter_file(linears, "lora", kohya("lora_unet_")))


@pytest.mark.parametrize("family", ["lora", *WEIGHT_FAMILIES])
@pytest.mark.parametrize("name", NAMES)
def test_runtime_forward_equals_merge(models, name, family):
    m = built(models, name)
    sd = adapter_file(all_linears(m.diffusers), family, kohya("lora_unet_"))
    forward = FORWARDS[name]
    merged, runtime, base = runtime_and_merge(m, sd, lambda m, model: forward(model.model.diffusion_model))
    assert (merged - base).abs().max() > 100 * FORWARD_ATOL, "the adapter changed nothing"
    assert torch.allclose(runtime, merged, rtol=0, atol=FORWARD_ATOL), (runtime - merged).abs().max()


def test_ltx2_text_connectors_land(models):
    # ComfyUI keeps LTX-2's text connectors inside its diffusion model; diffusers' transformer has none (they are a
    # pipeline component of their own), so these keys land by ComfyUI's own names. Reference: fp64 W + s·γ·up@down.
    m = built(models, "ltx2")
    linears = {n: mod for n, mod in all_linears(comfy_modules(m)).items() if "embeddings_connector" in n}
    assert len(linears) >= 8
    sd = adapter_file(linears, "lora", dotted("diffusion_model."))
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    merged, base = merged_state(model), comfy_modules(m).state_dict()
    for name in linears:
        stem = f"diffusion_model.{name}"
        up, down = sd[f"{stem}.lora_up.weight"].double(), sd[f"{stem}.lora_down.weight"].double()
        gamma = sd[f"{stem}.alpha"].item() / down.shape[0]
        ref = base[f"{name}.weight"].double() + STRENGTH * gamma * (up @ down)
        assert rel(merged[f"{name}.weight"], ref) <= TOL, name


@pytest.mark.parametrize(
    ("name", "key"),
    [("ltx2", "scale_shift_table"), ("ltx2", "transformer_blocks.1.scale_shift_table")],
)
def test_parameters_on_modules_with_children_land(models, name, key):
    # LTX-2's scale_shift_table (root and blocks) sits on modules with children (ComfyUI's Lumina 2 has no such
    # parameter; Z-Image's x_pad_token: test_comfy_archs.py): ComfyUI accepts a "diff" patch there and never applies
    # it, so it lands as an object patch, equal to loraweave.apply's on the twin.
    c = import_comfy()
    m = built(models, name)
    base = comfy_modules(m).get_parameter(key).detach().clone()
    sd = {f"diffusion_model.{key}.diff": torch.randn(base.shape, generator=torch.Generator().manual_seed(4))}
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == 1, report.kinds()
    c.model_management.load_models_gpu([model])
    landed = model.model.diffusion_model.get_parameter(key).detach().clone()
    c.model_management.unload_all_models()
    model.detach(unpatch_all=True)
    ref = twin_reference(m, sd)[key]
    assert not torch.equal(ref, base) and rel(landed, ref) <= TOL
    assert torch.equal(comfy_modules(m).get_parameter(key), base)  # the input MODEL is untouched
