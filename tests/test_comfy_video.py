"""loraweave.comfy on Wan 2.2 (TI2V 5B; the A14B noise experts, loaded as two MODELs), Wan Animate, HiDream,
LTX-Video 0.9 and PixArt Sigma / Alpha, each a tiny model built the way ComfyUI loads it (helpers.comfy_video).
References, as in test_comfy_dits.py:
- merge: `loraweave.apply` on the diffusers twin (diffusers' single-file converter of the same weights; PixArt:
  ComfyUI's own pixart_to_diffusers rows, checked here against an fp64 formula), ComfyUI's merged weights mapped
  through the same row map (1e-6 relative per weight);
- ComfyUI's own LoraLoader: its verdict per layout in CORE_VERDICTS, bit-identical to ours where it is right;
- runtime: the model's forward with mode="runtime" within 1e-5 (absolute) of the merge.
Fused rows exercised: PixArt's self-attention qkv (q | k | v) and cross-attention kv_linear (k | v), Wan Animate's
face-adapter linear1_kv (k | v)."""

from __future__ import annotations

import copy

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
from helpers.comfy_dits import DitModel
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted, kohya
from helpers.comfy_video import VIDEO_BUILDERS, VIDEO_FORWARDS, tiny_wan22_expert

import loraweave
from loraweave.comfy import load_lora_for_models

NAMES = list(VIDEO_BUILDERS)
FAMILIES = ("lora", "lokr", "loha")

# ComfyUI v0.19.3's own LoraLoader on a LoRA, by layout (measured): "identical" (lands every key, bit for bit as
# ours), "drops" (patches other keys than ours: some or all keys not loaded), "off" (lands, but wrong rows).
# kohya on diffusers names lands in core only where ComfyUI's names are diffusers' (HiDream; LTX-Video's blocks);
# diffusers / PEFT `transformer.` names only where core has a diffusers key map (PixArt, HiDream).
CORE_VERDICTS: dict[tuple[str, str], str] = {
    **{(name, "comfy"): "identical" for name in NAMES},
    **{
        (name, layout): "drops"
        for name in ("wan22-5b", "wan-animate")
        for layout in ("kohya-diffusers", "diffusers", "peft")
    },
    ("ltx-video", "kohya-diffusers"): "identical",
    ("ltx-video", "diffusers"): "drops",
    ("ltx-video", "peft"): "drops",
    **{("hidream", layout): "identical" for layout in ("kohya-diffusers", "diffusers", "peft")},
    **{(name, "kohya-diffusers"): "drops" for name in ("pixart-sigma", "pixart-alpha")},
    **{
        (name, layout): "identical"
        for name in ("pixart-sigma", "pixart-alpha")
        for layout in ("diffusers", "peft")
    },
}


@pytest.fixture(scope="module")
def models():
    return {}


def built(models, name: str) -> DitModel:
    return built_once(models, VIDEO_BUILDERS, name)


def layout_file(m: DitModel, layout: str, family: str = "lora") -> dict[str, torch.Tensor]:
    if layout == "kohya-diffusers":
        return adapter_file(block_linears(m.diffusers), family, kohya("lora_unet_"))
    if layout == "comfy":
        return adapter_file(block_linears(comfy_modules(m)), family, kohya("lora_unet_"))
    if layout == "diffusers":
        return adapter_file(block_linears(m.diffusers), family, dotted("transformer."))
    if layout == "peft":
        return adapter_file(block_linears(m.diffusers), family, dotted("transformer."), peft=True)
    raise ValueError(layout)


LAYOUTS = ("kohya-diffusers", "comfy", "diffusers", "peft")


@pytest.mark.parametrize("name", [n for n in NAMES if n != "hidream"])
def test_reference_tree_at_model_widths(models, name, caplog):
    # Keys resolve on the diffusers tree at the tiny model's widths (reference.py reads ComfyUI's unet_config), not
    # on the fallback of ComfyUI's own names that a fits=no WARNING announces.
    check_reference_tree(built(models, name), caplog)


def test_hidream_keeps_the_diffusers_names(models):
    # ComfyUI's HiDream is diffusers' module for module (diffusers' converter only strips the prefix): keys resolve
    # on ComfyUI's own modules, with no reference tree (loraweave's catalog has no HiDream skeleton).
    from loraweave.comfy.targets import reference_tree

    m = built(models, "hidream")
    assert reference_tree(m.patcher) is None
    ours = {k: tuple(v.shape) for k, v in comfy_modules(m).state_dict().items()}
    assert ours == {k: tuple(v.shape) for k, v in m.diffusers.state_dict().items()}


# Wan Animate's `transformer.` names are checked once (PEFT): its motion encoder makes each check cost seconds.
LORA_CASES = [(n, lay) for n in NAMES for lay in LAYOUTS if n != "wan-animate" or lay != "diffusers"]


@pytest.mark.parametrize(("name", "layout"), LORA_CASES)
def test_lora_layouts_and_core_verdict(models, name, layout):
    m = built(models, name)
    sd = layout_file(m, layout)
    model = check_against_twin(m.as_diffusers, m, sd)
    assert comfy_core_verdict(m.as_diffusers, m, model, sd) == CORE_VERDICTS[name, layout]


# Wan Animate's blocks are Wan's (their diffusers names are test_comfy_weights.py's): ComfyUI's names there, where
# the face adapter's fused linear1_kv is; its 512 px motion encoder makes each check cost seconds.
LYCORIS_CASES = [(n, lay) for n in NAMES for lay in LAYOUTS[:3] if n != "wan-animate" or lay == "comfy"]


@pytest.mark.parametrize("family", ["lokr", "loha"])
@pytest.mark.parametrize(("name", "layout"), LYCORIS_CASES)
def test_lycoris_layouts(models, name, layout, family):
    m = built(models, name)
    check_against_twin(m.as_diffusers, m, layout_file(m, layout, family))


@pytest.mark.parametrize("name", NAMES)
def test_every_linear_lands(models, name):
    # Every Linear of the model (embedders, modulation, experts, encoders, final layers), in ComfyUI's
    # `diffusion_model.` layout and in kohya's on diffusers names.
    m = built(models, name)
    for sd in (
        adapter_file(all_linears(comfy_modules(m)), "lora", dotted("diffusion_model.")),
        adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_")),
    ):
        check_against_twin(m.as_diffusers, m, sd)


@pytest.mark.parametrize("name", NAMES)
def test_runtime_forward_equals_merge(models, name):
    m = built(models, name)
    sd = adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_"))
    forward = VIDEO_FORWARDS[name]
    merged, runtime, base = runtime_and_merge(m, sd, lambda m, model: forward(model.model.diffusion_model))
    assert (merged - base).abs().max() > 100 * FORWARD_ATOL, "the adapter changed nothing"
    assert torch.allclose(runtime, merged, rtol=0, atol=FORWARD_ATOL), (runtime - merged).abs().max()


def parent_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that sit directly on a module with children (ComfyUI never applies a patch there)."""
    return {
        f"{path}.{n}" if path else n: p
        for path, mod in module.named_modules()
        if any(True for _ in mod.children())
        for n, p in mod._parameters.items()
        if p is not None
    }


@pytest.mark.parametrize("name", NAMES)
def test_parameters_on_modules_with_children(models, name):
    # A "diff" for each such parameter lands (an object patch: W + s·diff in fp64) or is named in the report with a
    # reason; ComfyUI's input MODEL stays untouched either way.
    c = import_comfy()
    m = built(models, name)
    params = parent_parameters(comfy_modules(m))
    assert sorted(params) == CHILD_PARAMETERS[name][0] + CHILD_PARAMETERS[name][1]
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
    assert landed == CHILD_PARAMETERS[name][0], named
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


# Parameters on modules with children, per model: (those that land, those named in the report).
_PIXART_TABLES = ["blocks.0.scale_shift_table", "blocks.1.scale_shift_table", "final_layer.scale_shift_table"]
CHILD_PARAMETERS: dict[str, tuple[list[str], list[str]]] = {
    "wan22-5b": (["blocks.0.modulation", "blocks.1.modulation", "head.modulation"], []),
    "wan-animate": (
        [*(f"blocks.{i}.modulation" for i in range(5)), "face_encoder.padding_tokens", "head.modulation"],
        [],
    ),
    "ltx-video": (
        [
            "scale_shift_table",
            "transformer_blocks.0.scale_shift_table",
            "transformer_blocks.1.scale_shift_table",
        ],
        [],
    ),
    "hidream": ([], []),  # its MoE gate weights sit on childless modules: ordinary patches
    "pixart-sigma": (_PIXART_TABLES, []),
    "pixart-alpha": (_PIXART_TABLES, []),
}


@pytest.fixture(scope="module")
def experts():
    return tiny_wan22_expert(0), tiny_wan22_expert(1)


def test_wan22_experts_take_one_file_each_at_its_strength(experts):
    # Wan 2.2 A14B: ComfyUI loads the high- and low-noise experts as two MODELs; a LoRA trained for both is loaded
    # on each (two loader nodes), each at its own strength. Each merge equals loraweave.apply on its own twin.
    high, low = experts
    sd = adapter_file(all_linears(comfy_modules(high)), "lora", dotted("diffusion_model."))
    for m, strength in ((high, 1.0), (low, 0.4)):
        model, _, report = load_lora_for_models(m.patcher, None, sd, strength, 0.0, mode="merge")
        assert report.keys_applied == report.keys_total == len(sd), report.kinds()
        twin = copy.deepcopy(m.diffusers)
        loraweave.apply(twin, sd, mode="merge", strength=strength)
        ours, ref = m.as_diffusers(merged_state(model)), twin.state_dict()
        assert max(rel(ours[k], ref[k]) for k in ref) <= TOL
    assert not torch.equal(
        comfy_modules(high).blocks[0].ffn[0].weight, comfy_modules(low).blocks[0].ffn[0].weight
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wan22_expert_layouts(experts, layout):
    m = experts[1]
    check_against_twin(m.as_diffusers, m, layout_file(m, layout))


def test_pixart_row_map_against_fp64(models):
    # The PixArt row map (ComfyUI's pixart_to_diffusers) checked on its own: a kohya LoRA on the fused qkv and
    # kv_linear, merged by us, equals W + s·γ·up@down in fp64 on the fused tensor, and the twin's to_q/to_k/to_v
    # hold its row thirds (kv: halves) in that order.
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
    assert (
        rel(
            twin["transformer_blocks.1.attn1.to_k.weight"], ref_twin["transformer_blocks.1.attn1.to_k.weight"]
        )
        <= TOL
    )
    assert torch.equal(twin["transformer_blocks.1.attn1.to_k.weight"], k)
