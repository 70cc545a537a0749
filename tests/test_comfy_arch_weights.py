"""loraweave.comfy on every architecture with ComfyUI facets, by the weights it writes: a tiny model per case
(helpers.comfy_arch_cases). The families whose ΔW reads the weight (DoRA on both magnitude axes, OFT, BOFT) on
ComfyUI's fused slices, the runtime path's forward against the merge (FORWARD_ATOL = 1e-5 absolute),
parameters on modules with children (object patches: W + s·diff), and the modules ComfyUI keeps inside its
diffusion model that diffusers' transformer lacks (LTX-2's text connectors, Anima's LLM adapter), against the
diffusers twin or the fp64 formula on ComfyUI's own rows, TOL = 1e-6 relative per weight."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_arch_cases import CASES, built_case, check_fp64, parent_parameters
from helpers.comfy_checks import (
    FORWARD_ATOL,
    STRENGTH,
    TOL,
    all_linears,
    block_linears,
    check_against_twin,
    comfy_core_verdict,
    comfy_modules,
    merged_state,
    rel,
    runtime_and_merge,
    twin_reference,
)
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted, kohya

from loraweave.comfy import load_lora_for_models
from loraweave.errors import NoKeysLandedError


@pytest.fixture(scope="module")
def models():
    return {}


def built(models, name: str):
    return built_case(models, name)


def weight_file(m, family: str, layout: str) -> dict[str, torch.Tensor]:
    """A kohya `family` file on every block Linear, by the twin's names ("diffusers") or ComfyUI's."""
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


WEIGHT_CASES = [
    pytest.param(name, family, layout, id=f"{name}-{family}-{layout}")
    for name, case in CASES.items()
    for (family, layout) in case.weight_verdicts
]


@pytest.mark.parametrize(("name", "family", "layout"), WEIGHT_CASES)
def test_weight_dependent_families(models, name, family, layout):
    # On the twin's names a part lands on the rows of ComfyUI's fused module that the twin module holds (the
    # slice ComfyUI narrows); on ComfyUI's names a fused part is split per row range over the twin's modules.
    # ComfyUI core: where it loads a file it is off (its DoRA blends the strength outside the norm, its OFT
    # and BOFT apply it twice); ours is within 1e-6 of loraweave.apply on the twin in every cell.
    m = built(models, name)
    sd = weight_file(m, family, layout)
    model = check_against_twin(m.as_diffusers, m, sd)
    verdict = comfy_core_verdict(m.as_diffusers, m, model, sd)
    assert verdict == CASES[name].weight_verdicts[family, layout]


def split_in_comfy(m, sd: dict[str, torch.Tensor]) -> set[str]:
    """The stems of `sd` whose twin module ComfyUI holds as several row ranges (SD3's last context block and
    final layer: shift and scale halves swapped), read from our plan of the same stems as a plain LoRA."""
    from loraweave.comfy.api import read_lora
    from loraweave.comfy.targets import plan_for_patcher

    stems = {k.rsplit(".", 2)[0] for k in sd if k.endswith(".lora_down.weight")}
    lora = {k: v for k, v in sd.items() if not k.endswith(".dora_scale")}
    plan = plan_for_patcher(m.patcher, read_lora(lora))
    return {pp.part.keys[0].rsplit(".", 2)[0] for pp in plan.planned if len(pp.pieces) > 1} & stems


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.input_axis_dora])
def test_input_axis_dora_on_fused_slices(models, name):
    # The column norm runs over every row of the twin's module: on ComfyUI's fused qkv / linear1 that is the
    # rows of the slice ComfyUI hands over (q alone, k alone...), never the whole fused weight. A module
    # ComfyUI holds in several row ranges cannot give the norm range by range: refused and named, nothing
    # patched there.
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


RUNTIME_CASES = [
    pytest.param(name, family, id=f"{name}-{family}")
    for name, case in CASES.items()
    for family in case.runtime
]


@pytest.mark.parametrize(("name", "family"), RUNTIME_CASES)
def test_runtime_forward_equals_merge(models, name, family):
    m, case = built(models, name), CASES[name]
    sd = adapter_file(case.runtime_linears(m.diffusers), family, kohya("lora_unet_"))
    merged, runtime, base = runtime_and_merge(
        m, sd, lambda m, model: case.forward(model.model.diffusion_model)
    )
    assert (merged - base).abs().max() > 100 * FORWARD_ATOL, "the adapter changed nothing"
    assert torch.allclose(runtime, merged, rtol=0, atol=FORWARD_ATOL), (runtime - merged).abs().max()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.parent_parameters is not None])
def test_parameters_on_modules_with_children(models, name):
    # A "diff" for each such parameter lands (an object patch: W + s·diff in fp64) or is named in the report
    # with a reason; ComfyUI's input MODEL stays untouched either way. The cases list them (measured on
    # ComfyUI's classes at the tiny widths; HunyuanVideo 1.5's cond_type_embedding is an Embedding leaf).
    c = import_comfy()
    m = built(models, name)
    lands, named_ones = CASES[name].parent_parameters
    params = parent_parameters(comfy_modules(m))
    assert sorted(params) == lands + named_ones
    if not params:
        return
    base = {k: p.detach().clone() for k, p in params.items()}
    g = torch.Generator().manual_seed(4)
    sd = {f"diffusion_model.{k}.diff": torch.randn(p.shape, generator=g) * 0.1 for k, p in params.items()}
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    named = {u.key: u.reason for u in report.unmatched}
    assert all(named.values()) and set(named) <= set(sd), report.kinds()
    landed = sorted(k.removeprefix("diffusion_model.").removesuffix(".diff") for k in set(sd) - set(named))
    assert report.keys_applied == len(landed) and report.keys_total == len(sd)
    assert landed == lands, named
    c.model_management.load_models_gpu([model])
    after = {k: model.model.diffusion_model.get_parameter(k).detach().clone() for k in params}
    c.model_management.unload_all_models()
    model.detach(unpatch_all=True)
    for k in params:
        if k in landed:
            ref = base[k].double() + STRENGTH * sd[f"diffusion_model.{k}.diff"].double()
            assert rel(after[k], ref) <= TOL, k
        else:
            assert torch.equal(after[k], base[k]), k
        assert torch.equal(comfy_modules(m).get_parameter(k), base[k]), k  # the input MODEL is untouched


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("z-image", "x_pad_token"),
        ("ltx2", "scale_shift_table"),
        ("ltx2", "transformer_blocks.1.scale_shift_table"),
    ],
)
def test_parameters_on_modules_with_children_land_as_on_the_twin(models, name, key):
    # Z-Image's x_pad_token (a parameter of the root NextDiT) and LTX-2's scale_shift_table (root and blocks)
    # sit on modules with children: ComfyUI accepts a "diff" patch there and never applies it, so it lands as
    # an object patch, equal to loraweave.apply's on the twin.
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
    assert not torch.equal(ref, base) and not torch.equal(ref, m.diffusers.get_parameter(key))
    assert rel(landed, ref) <= TOL
    # the input MODEL is untouched, equal to the twin's
    assert torch.equal(comfy_modules(m).get_parameter(key), base)
    assert torch.equal(base, m.diffusers.get_parameter(key))


def test_ltx2_text_connectors_land(models):
    # ComfyUI keeps LTX-2's text connectors inside its diffusion model; diffusers' transformer has none (they
    # are a pipeline component of their own), so these keys land by ComfyUI's own names. Reference: fp64 W +
    # s·γ·up@down.
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


def test_anima_llm_adapter_lands(models):
    # ComfyUI keeps Anima's LLM adapter inside its diffusion model; diffusers makes it a pipeline component of
    # its own (text_conditioner), so these keys land by ComfyUI's names. Reference: the fp64 formula.
    m = built(models, "anima")
    linears = {n: mod for n, mod in all_linears(comfy_modules(m)).items() if n.startswith("llm_adapter.")}
    assert len(linears) >= 8
    for stem_of in (dotted("diffusion_model."), kohya("lora_unet_")):
        sd = adapter_file(linears, "lora", stem_of)
        names = dict(zip(map(stem_of, linears), linears, strict=True))
        check_fp64(m, sd, lambda stem, names=names: (names[stem], 0))


def test_pixart_row_map_against_fp64(models):
    # The PixArt row map (ComfyUI's pixart_to_diffusers) checked on its own: a kohya LoRA on the fused qkv and
    # kv_linear, merged by us, equals W + s·γ·up@down in fp64 on the fused tensor, and the twin's
    # to_q/to_k/to_v hold its row thirds (kv: halves) in that order.
    m = built(models, "pixart-sigma")
    mods = {n: mod for n, mod in comfy_modules(m).named_modules() if n.endswith(("attn.qkv", "kv_linear"))}
    sd = adapter_file(mods, "lora", kohya("lora_unet_"))
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd)
    merged, base = merged_state(model), comfy_modules(m).state_dict()
    for name in mods:
        stem = "lora_unet_" + name.replace(".", "_")
        up, down = sd[f"{stem}.lora_up.weight"].double(), sd[f"{stem}.lora_down.weight"].double()
        ref = base[f"{name}.weight"].double() + STRENGTH * (sd[f"{stem}.alpha"].item() / 2) * (up @ down)
        assert rel(merged[f"{name}.weight"], ref) <= TOL, name
    twin = m.as_diffusers(merged)
    q, k, v = merged["blocks.1.attn.qkv.weight"].chunk(3)
    assert torch.equal(twin["transformer_blocks.1.attn1.to_q.weight"], q)
    assert torch.equal(twin["transformer_blocks.1.attn1.to_v.weight"], v)
    ck, cv = merged["blocks.1.cross_attn.kv_linear.weight"].chunk(2)
    assert torch.equal(twin["transformer_blocks.1.attn2.to_k.weight"], ck)
    assert torch.equal(twin["transformer_blocks.1.attn2.to_v.weight"], cv)
    ref_twin = twin_reference(m, sd)
    to_k = "transformer_blocks.1.attn1.to_k.weight"
    assert rel(twin[to_k], ref_twin[to_k]) <= TOL
    assert torch.equal(twin[to_k], k)
