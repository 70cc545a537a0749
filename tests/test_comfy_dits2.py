"""loraweave.comfy on HunyuanVideo 1.5, HunyuanImage 2.1, Kandinsky 5, ERNIE-Image, Anima and Cosmos-Predict2, each a
tiny model built the way ComfyUI loads it (helpers.comfy_dits2: ComfyUI's own detection picks the supported_models
class). References:
- merge: `loraweave.apply` on the diffusers twin, ComfyUI's merged weights mapped to the twin's names by the row map
  (helpers.comfy_dits2), 1e-6 relative per weight; and, independent of any row map, the fp64 formula
  W + s·γ·up@down on ComfyUI's own tensor rows (`fp64_reference`) for files in ComfyUI's and the trainers'
  original names (the split q / k / v of musubi-tuner's HunyuanVideo 1.5 land on thirds of ComfyUI's fused qkv);
- ComfyUI's own LoraLoader: bit-identical wherever it lands the same keys within that tolerance (CORE_VERDICTS);
- runtime: the model's forward with mode="runtime" within 1e-5 (absolute, outputs of magnitude ~1) of the merge."""

from __future__ import annotations

import re

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
)
from helpers.comfy_dits import DitModel
from helpers.comfy_dits2 import DIT2_BUILDERS, VARIANT_BUILDERS
from helpers.comfy_files import adapter_file, dotted, kohya

from loraweave.comfy import load_lora_for_models

NAMES = list(DIT2_BUILDERS)
HUNYUAN = ("hunyuan-video-1.5", "hunyuan-image-2.1")
# LoKr / LoHa where rows fuse or names change (DoRA / OFT ride the same row maps: test_comfy_weights.py); LoRA on all.
FAMILY_CASES = [
    (n, f) for n in NAMES for f in ("lora", "lokr", "loha") if f == "lora" or n in (*HUNYUAN, "anima")
]
# Cosmos-Predict2 is Anima's DiT (same ComfyUI class, diffusers class and table) without the LLM adapter: it runs
# the checks that prove ComfyUI's supported_models class maps to that table; the layouts run on Anima.
LAYOUT_NAMES = [n for n in NAMES if n != "cosmos-predict2"]


def _inputs(*shapes):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=g) for s in shapes]


def _forward_hv15(dm):
    x, ctx, byt5, vision = _inputs((1, 65, 1, 4, 4), (1, 5, 32), (1, 3, 1472), (1, 2, 1152))
    return dm(x, torch.tensor([0.5]), ctx, txt_byt5=byt5, clip_fea=vision)


def _forward_hi21(dm):
    x, ctx, byt5 = _inputs((1, 64, 4, 4), (1, 5, 32), (1, 3, 1472))
    return dm(x, torch.tensor([0.5]), ctx, txt_byt5=byt5, guidance=torch.tensor([3.0]), disable_time_r=True)


def _forward_kandinsky5(dm):
    x, ctx, pooled = _inputs((1, 33, 1, 4, 4), (1, 5, 32), (1, 24))
    return dm(x, torch.tensor([0.5]), ctx, pooled)


def _forward_ernie(dm):
    x, ctx = _inputs((1, 16, 4, 4), (1, 5, 32))
    return dm(x, torch.tensor([0.5]), ctx)


def _forward_cosmos(dm):
    x, ctx = _inputs((1, 16, 1, 4, 4), (1, 5, 1024))
    return dm(x, torch.tensor([0.5]), ctx)


FORWARDS = {
    "hunyuan-video-1.5": _forward_hv15,
    "hunyuan-image-2.1": _forward_hi21,
    "kandinsky5": _forward_kandinsky5,
    "ernie-image": _forward_ernie,
    "anima": _forward_cosmos,
    "cosmos-predict2": _forward_cosmos,
}

# ComfyUI v0.19.3's own LoraLoader on a LoRA, by layout (measured): it maps each model's own (original) names, kohya
# `lora_unet_` and `diffusion_model.`, and lands them bit for bit as ours; kohya on diffusers names it drops but
# where the diffusers port kept the original names (Kandinsky 5, ERNIE-Image). The trainers' split q / k / v on
# HunyuanVideo 1.5 / HunyuanImage 2.1 it drops too (test_hunyuan_trainer_split_names).
CORE_VERDICTS = {
    **{(name, "diffusers"): "drops" for name in NAMES},
    **{(name, "comfy"): "identical" for name in NAMES},
    ("kandinsky5", "diffusers"): "identical",
    ("ernie-image", "diffusers"): "identical",
}


@pytest.fixture(scope="module")
def models():
    return {}


def built(models, name: str) -> DitModel:
    return built_once(models, DIT2_BUILDERS, name)


def dit_linears(m: DitModel) -> dict[str, torch.nn.Linear]:
    """Every Linear of ComfyUI's model but Anima's LLM adapter (no module of the diffusers transformer)."""
    return {n: mod for n, mod in all_linears(comfy_modules(m)).items() if not n.startswith("llm_adapter.")}


def fp64_reference(m: DitModel, sd: dict, where) -> dict[str, torch.Tensor]:
    """{ComfyUI weight: W + s·γ·up@down in fp64} for a LoRA file: `where(stem)` -> (ComfyUI module, first row)."""
    base = {k: v.double() for k, v in comfy_modules(m).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key in sd:
        if not key.endswith(".lora_down.weight"):
            continue
        stem = key.removesuffix(".lora_down.weight")
        up, down = sd[f"{stem}.lora_up.weight"].double(), sd[key].double()
        gamma = sd[f"{stem}.alpha"].item() / down.shape[0]
        module, row = where(stem)
        weight = out.setdefault(f"{module}.weight", base[f"{module}.weight"].clone())
        weight[row : row + up.shape[0]] += STRENGTH * gamma * (up @ down)
    return out


def check_fp64(m: DitModel, sd: dict, where, model=None) -> None:
    """Our merge of `sd` (every key lands; `model`: a MODEL our loader patched with it already) equals the fp64
    formula on ComfyUI's own tensors; every other weight is unchanged."""
    if model is None:
        model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
        assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    ref, merged = fp64_reference(m, sd, where), merged_state(model)
    assert len(ref) >= 4
    errors = {k: rel(merged[k], ref[k]) for k in ref}
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])
    untouched = set(merged) - set(ref)
    base = comfy_modules(m).state_dict()
    assert all(torch.equal(merged[k], base[k]) for k in untouched), "a weight outside the file's keys changed"


@pytest.mark.parametrize("name", NAMES)
def test_reference_tree_at_model_widths(models, name, caplog):
    # Keys resolve on the diffusers tree at the tiny model's widths (reference.py reads ComfyUI's unet_config), not
    # on the fallback of ComfyUI's own names that a fits=no WARNING announces.
    check_reference_tree(built(models, name), caplog)


@pytest.mark.parametrize("name", NAMES)
def test_kohya_on_diffusers_names(models, name):
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", kohya("lora_unet_"))
    model = check_against_twin(m.as_diffusers, m, sd)
    assert comfy_core_verdict(m.as_diffusers, m, model, sd) == CORE_VERDICTS[name, "diffusers"]


@pytest.mark.parametrize(("name", "family"), FAMILY_CASES)
def test_kohya_on_comfy_names(models, name, family):
    # ComfyUI's own (original) module names: fused rows land per range on the twin's split modules.
    m = built(models, name)
    sd = adapter_file(block_linears(comfy_modules(m)), family, kohya("lora_unet_"))
    model = check_against_twin(m.as_diffusers, m, sd)
    if family == "lora":
        assert comfy_core_verdict(m.as_diffusers, m, model, sd) == CORE_VERDICTS[name, "comfy"]


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_peft_diffusers_layout(models, name):
    m = built(models, name)
    sd = adapter_file(block_linears(m.diffusers), "lora", dotted("transformer."), peft=True)
    check_against_twin(m.as_diffusers, m, sd)


@pytest.mark.parametrize("name", NAMES)
def test_every_linear_lands(models, name):
    # Every Linear of the model, embedders, modulation, refiners and final layers included, in ComfyUI's
    # `diffusion_model.` layout (also against the fp64 formula on the weight of the same name, independent of any
    # row map) and in kohya's on diffusers names.
    m = built(models, name)
    sd = adapter_file(dit_linears(m), "lora", dotted("diffusion_model."))
    model = check_against_twin(m.as_diffusers, m, sd)
    check_fp64(m, sd, lambda stem: (stem.removeprefix("diffusion_model."), 0), model)
    check_against_twin(m.as_diffusers, m, adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_")))


# Original names the trainers write for HunyuanVideo 1.5 / HunyuanImage 2.1 that ComfyUI's model fuses: musubi-tuner
# and sd-scripts split every double-block qkv, the official HunyuanImage code splits the single blocks' linear1.
_SPLIT = {
    r"(double_blocks\.\d+)\.(img|txt)_attn\.qkv": ("{0}.{1}_attn_{p}", "qkv"),
    r"(single_blocks\.\d+)\.linear1": ("{0}.linear1_{p}", ("q", "k", "v", "mlp")),
}
_TENCENT = ((".img_mod.lin", ".img_mod.linear"), (".txt_mod.lin", ".txt_mod.linear"),
            ("_attn.proj", "_attn_proj"), ("_mlp.0", "_mlp.fc1"), ("_mlp.2", "_mlp.fc2"),
            (".modulation.lin", ".modulation.linear"))  # fmt: skip


def split_original_file(m: DitModel, seed: int = 5) -> tuple[dict, dict]:
    """A kohya LoRA on the trainers' split names over every double/single block Linear, and
    {stem: (ComfyUI module, first row)} of each key."""
    g = torch.Generator().manual_seed(seed)
    hidden = comfy_modules(m).hidden_size
    sd, where = {}, {}
    for name, mod in block_linears(comfy_modules(m)).items():
        parts = [(name, 0, mod.weight.shape[0], name)]
        for pattern, (spelling, pieces) in _SPLIT.items():
            if (hit := re.fullmatch(pattern, name)) is not None:
                rows = [hidden] * 3 + [mod.weight.shape[0] - 3 * hidden] * (len(pieces) == 4)
                starts = [sum(rows[:j]) for j in range(len(rows))]
                parts = [(spelling.format(*hit.groups(), p=p), s, n, name)
                         for p, s, n in zip(pieces, starts, rows, strict=True)]  # fmt: skip
        for original, start, rows_, comfy in parts:
            for old, new in _TENCENT:
                original = original.replace(old, new)
            stem = "lora_unet_" + original.replace(".", "_")
            sd[f"{stem}.lora_down.weight"] = torch.randn(2, mod.weight.shape[1], generator=g)
            sd[f"{stem}.lora_up.weight"] = torch.randn(rows_, 2, generator=g) * 0.1
            sd[f"{stem}.alpha"] = torch.tensor(1.0)
            where[stem] = (comfy, start)
    return sd, where


@pytest.mark.parametrize("name", HUNYUAN)
def test_hunyuan_trainer_split_names(models, name):
    m = built(models, name)
    sd, where = split_original_file(m)
    assert any("img_attn_q." in k for k in sd) and any("mlp_fc1" in k for k in sd)
    assert name == "hunyuan-video-1.5" or any("linear1_mlp" in k for k in sd)
    model = check_against_twin(m.as_diffusers, m, sd)
    check_fp64(m, sd, where.__getitem__, model)
    assert comfy_core_verdict(m.as_diffusers, m, model, sd) == "drops"


@pytest.mark.parametrize("name", NAMES)
def test_runtime_forward_equals_merge(models, name):
    m = built(models, name)
    sd = adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_"))
    forward = FORWARDS[name]
    merged, runtime, base = runtime_and_merge(m, sd, lambda m, model: forward(model.model.diffusion_model))
    assert (merged - base).abs().max() > 100 * FORWARD_ATOL, "the adapter changed nothing"
    assert torch.allclose(runtime, merged, rtol=0, atol=FORWARD_ATOL), (runtime - merged).abs().max()


def test_anima_llm_adapter_lands(models):
    # ComfyUI keeps Anima's LLM adapter inside its diffusion model; diffusers makes it a pipeline component of its own
    # (text_conditioner), so these keys land by ComfyUI's names. Reference: the fp64 formula.
    m = built(models, "anima")
    linears = {n: mod for n, mod in all_linears(comfy_modules(m)).items() if n.startswith("llm_adapter.")}
    assert len(linears) >= 8
    for stem_of in (dotted("diffusion_model."), kohya("lora_unet_")):
        sd = adapter_file(linears, "lora", stem_of)
        names = dict(zip(map(stem_of, linears), linears, strict=True))
        check_fp64(m, sd, lambda stem, names=names: (names[stem], 0))


def parameters_on_parents(module: torch.nn.Module) -> list[str]:
    return [
        f"{owner}.{p}" if owner else p
        for owner, mod in module.named_modules()
        if next(mod.children(), None) is not None
        for p, _ in mod.named_parameters(recurse=False)
    ]


# Parameters on modules with children (ComfyUI accepts a patch there and never applies it): these models have none
# (measured on ComfyUI's classes at the tiny widths; HunyuanVideo 1.5's cond_type_embedding is an Embedding leaf).
PARAMETERS_ON_PARENTS: dict[str, list[str]] = {name: [] for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_parameters_on_modules_with_children_are_named(models, name):
    m = built(models, name)
    assert parameters_on_parents(comfy_modules(m)) == PARAMETERS_ON_PARENTS[name]


@pytest.mark.parametrize("name", list(VARIANT_BUILDERS))
def test_sibling_releases_map_to_their_tables(name, caplog):
    # ComfyUI's own supported_models classes for HunyuanVideo 1.5's SR model and HunyuanImage 2.1's refiner reach
    # the same tables: a reference tree at the model's widths, and every Linear lands in both layouts.
    m = VARIANT_BUILDERS[name]()
    check_reference_tree(m, caplog)
    sd = adapter_file(all_linears(comfy_modules(m)), "lora", dotted("diffusion_model."))
    model = check_against_twin(m.as_diffusers, m, sd)
    check_fp64(m, sd, lambda stem: (stem.removeprefix("diffusion_model."), 0), model)
    check_against_twin(m.as_diffusers, m, adapter_file(all_linears(m.diffusers), "lora", kohya("lora_unet_")))
