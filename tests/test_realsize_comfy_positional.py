"""Every real cloneofsimo file (positional keys `unet:<i>`, `text_encoder:<i>`) in ../shared/realdata/lora
through the ComfyUI pack (`loraweave.comfy.load_lora_for_models`, merge) on ComfyUI's own full-size SD1.5
model and CLIP, equal row by row to `loraweave.apply` on the diffusers twin (UNet2DConditionModel and
transformers' CLIPTextModel); once called directly, once through ComfyUI's own validate_prompt and
PromptExecutor (a test-only source node -> the pack's LoraWeave Loader, the file in the loras folder -> a
test-only capture node).

A position counts Linear layers in the order cloneofsimo's trainer enumerated them on diffusers/transformers
classes; ComfyUI registers some in another order (its CLIPAttention holds q, k, v where transformers' holds
k, v, q), so a position resolved on ComfyUI's own tree lands on a same-shaped wrong layer and still "lands".

The models stay on the meta device: the twin's targeted Linears get seeded fp32 storage (the twin's plan
names them), ComfyUI's get the same values one layer at a time. Every row of every targeted weight is
compared: ComfyUI's merge (`patch_weight_to_device`) against the twin's merge, TOL relative per weight (a
failure names the worst ΔW's relative error too)."""

from __future__ import annotations

import shutil
import zlib
from contextlib import contextmanager

import pytest
import torch
from conftest import REALDATA
from helpers.comfy_checks import rel
from helpers.comfy_env import import_comfy
from helpers.comfy_full import META, SD15_UNET, meta_patcher
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.common import real_config
from helpers.realsize import fill_seeded

import loraweave
from loraweave.arch.aliases import AliasTable
from loraweave.comfy import load_lora_for_models, targets

pytestmark = pytest.mark.usefixtures("one_thread")  # 2 threads on 2 shared cores spin in OpenMP barriers
TOL = 1e-6  # relative, per weight: fp32 through two independent paths
STRENGTH_MODEL, STRENGTH_CLIP = 0.8, 0.6
CLIP_PREFIX = "clip_l.transformer.text_model."  # ComfyUI's CLIP state-dict names of the CLIP-L tower


def _cloneofsimo_files() -> list[str]:
    found = []
    for path in sorted((REALDATA / "lora").glob("*.safetensors")):
        if any(p.layout == "cloneofsimo" for p in loraweave.load_adapter(path).parts):
            found.append(path.name)
    return found


FILES = _cloneofsimo_files()


def test_the_real_cloneofsimo_files_are_found():
    assert "cloneofsimo__lora__analog_svd_rank4.safetensors" in FILES, FILES


def _seed(name: str) -> int:
    return zlib.crc32(name.encode())


@pytest.fixture(scope="module")
def comfy_sd15():
    """ComfyUI's own SD15 model and SD1 CLIP at full size, fp32, every weight on the meta device."""
    c = import_comfy()
    import comfy.sd1_clip
    import comfy.supported_models_base

    target = comfy.supported_models_base.ClipTarget(comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel)
    options = {"initial_device": META, "dtype": torch.float32}
    clip = c.sd.CLIP(target, model_options=options, disable_dynamic=True)
    return meta_patcher(c.supported_models.SD15, SD15_UNET, torch.float32), clip


def meta_twin() -> dict[str, torch.nn.Module]:
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(real_config("sd15__unet_config.json"))
        te = CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json")))
    return {"unet": unet, "text_encoder": te}


def materialize(layer: torch.nn.Module, seed: int) -> None:
    layer.to_empty(device="cpu", recurse=False)
    fill_seeded(layer.weight, seed)
    if layer.bias is not None:
        fill_seeded(layer.bias, seed + 1)


@contextmanager
def comfy_layer(root: torch.nn.Module, module: str, seed: int):
    """ComfyUI's layer `module` with seeded storage (the twin's values for that seed), yielding a copy of
    its weight; back on meta after."""
    layer = root.get_submodule(module)
    try:
        materialize(layer, seed)
        yield layer.weight.detach().clone()
    finally:
        layer.to("meta")


def comfy_names(c) -> dict[str, str]:
    """{twin component.module: ComfyUI patch key} for every Linear weight a position can name."""
    ldm = c.utils.unet_to_diffusers(SD15_UNET)  # {diffusers key: ldm key}
    out = {f"unet.{k.removesuffix('.weight')}": f"diffusion_model.{v}" for k, v in ldm.items()}
    te = meta_twin()["text_encoder"]
    for name, module in te.named_modules():
        if isinstance(module, torch.nn.Linear):
            inner = name.removeprefix("text_model.")  # transformers 5 drops the level
            out[f"text_encoder.{name}"] = f"{CLIP_PREFIX}{inner}.weight"
    return out


def twin_merged(path) -> dict[str, torch.Tensor]:
    """{twin component.module: merged weight} from loraweave.apply on the twin, only the planned Linears
    given storage."""
    twin = meta_twin()
    planned = loraweave.plan(twin, path)
    assert planned.keys_applied == planned.keys_total, planned.kinds()
    names = [f"{a.component}.{a.module}" for a in planned.applied]
    for name in names:
        component, _, module = name.partition(".")
        materialize(twin[component].get_submodule(module), _seed(name))
    spec = loraweave.AdapterSpec(path, strength=STRENGTH_MODEL, te_strength=STRENGTH_CLIP)
    handle = loraweave.apply(twin, spec, mode="merge")
    assert handle.report.keys_applied == handle.report.keys_total
    merged = {}
    for name in names:
        component, _, module = name.partition(".")
        merged[name] = twin[component].get_submodule(module).weight.detach().clone()
        twin[component].get_submodule(module).to("meta")
    return merged


def assert_equals_twin(comfy_sd15, model, new_clip, path) -> None:
    """Every weight the patched MODEL and CLIP hold patches for, realized by ComfyUI's own
    patch_weight_to_device on seeded storage, equals the twin's merge row by row (TOL relative)."""
    c = import_comfy()
    patcher, clip = comfy_sd15
    expected = twin_merged(path)
    keys = comfy_names(c)
    want = {keys[n]: n for n in expected}
    got = {k for k in model.patches} | {k for k in new_clip.patcher.patches}
    assert got == set(want), (sorted(got - set(want))[:4], sorted(set(want) - got)[:4])
    weight_errors, delta_errors = {}, {}
    for key, twin_name in want.items():
        on_clip = key.startswith("clip_l.")
        owner = new_clip.patcher if on_clip else model
        root = clip.cond_stage_model if on_clip else patcher.model
        with comfy_layer(root, key.removesuffix(".weight"), _seed(twin_name)) as base:
            merged = owner.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
        ref = expected[twin_name]
        # a ΔW on the wrong layer moves the weight by more than 100 TOL (the text encoder's: 6e-4 of max|W|)
        assert (ref - base).abs().max() > 100 * TOL * base.abs().max(), f"{twin_name}: ΔW too small to see"
        weight_errors[twin_name] = rel(merged, ref)
        delta_errors[twin_name] = rel(merged - base, ref - base)
    wrong = sorted(n for n in want.values() if weight_errors[n] > TOL)
    worst = max(delta_errors.items(), key=lambda kv: kv[1])
    assert not wrong, f"{len(wrong)} of {len(want)} weights off (worst ΔW {worst}): {wrong[:4]}"


@pytest.mark.parametrize("name", FILES)
def test_cloneofsimo_file_through_the_pack_equals_apply_on_the_twin(comfy_sd15, name):
    path = REALDATA / "lora" / name
    patcher, clip = comfy_sd15
    model, new_clip, report = load_lora_for_models(
        patcher, clip, path, STRENGTH_MODEL, STRENGTH_CLIP, mode="merge", strict=True
    )
    assert report.keys_applied == report.keys_total
    assert_equals_twin(comfy_sd15, model, new_clip, path)


# ---- through ComfyUI's own executor: a test-only source node -> LoraWeave Loader -> a capture node ---

SOURCE: dict[str, tuple] = {}  # what the source node hands out: (MODEL, CLIP)
CAPTURED: dict[str, tuple] = {}  # what the capture node received: (MODEL, CLIP, report)


class SD15Source:
    """ComfyUI's full-size SD1.5 MODEL and CLIP on meta (the module fixture's), as a checkpoint loader gives
    them."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    RETURN_TYPES = ("MODEL", "CLIP")
    FUNCTION = "run"
    CATEGORY = "loraweave_test"

    def run(self):
        return SOURCE["sd15"]


class LoaderCapture:
    """An output node holding the MODEL, CLIP and report it was wired to."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model": ("MODEL",), "clip": ("CLIP",), "report": ("STRING", {"forceInput": True})}
        }

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "loraweave_test"

    def run(self, model, clip, report):
        CAPTURED["loader"] = (model, clip, report)
        return {}


@pytest.fixture
def executor_nodes(comfy_sd15, monkeypatch):
    import nodes

    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "LWTestSD15Source", SD15Source)
    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "LWTestLoaderCapture", LoaderCapture)
    monkeypatch.setitem(SOURCE, "sd15", comfy_sd15)
    CAPTURED.clear()
    yield
    CAPTURED.clear()


@pytest.mark.parametrize("name", FILES)
def test_cloneofsimo_file_through_comfys_executor_equals_apply_on_the_twin(
    comfy_sd15, comfy_home, executor_nodes, name
):
    """The API-format prompt source -> LoraWeave Loader (merge, strict) -> capture, validated and run by
    ComfyUI's validate_prompt and PromptExecutor: the MODEL and CLIP it hands on equal the twin's merge."""
    loader = {"lora_name": name, "strength_model": STRENGTH_MODEL, "strength_clip": STRENGTH_CLIP}
    prompt = {
        "1": {"class_type": "LWTestSD15Source", "inputs": {}},
        "2": {
            "class_type": "LoraWeaveLoader",
            "inputs": {"model": ["1", 0], "clip": ["1", 1], **loader, "mode": "merge", "strict": True},
        },
        "3": {
            "class_type": "LWTestLoaderCapture",
            "inputs": {"model": ["2", 0], "clip": ["2", 1], "report": ["2", 2]},
        },
    }
    in_loras = comfy_home["base"] / "models" / "loras" / name  # the module's temp loras folder
    shutil.copy(REALDATA / "lora" / name, in_loras)
    try:
        valid, errors, ex, _ = run_prompt(prompt)
    finally:
        in_loras.unlink()  # later modules list that folder too
    assert valid and ex.success, errors or execution_error(ex)
    model, new_clip, report = CAPTURED["loader"]
    patcher, clip = comfy_sd15
    assert model is not patcher and new_clip is not clip, "the loader handed on its inputs"
    assert patcher.patches == {} and clip.patcher.patches == {}, "the source's MODEL or CLIP got patches"
    total = loraweave.load_adapter(REALDATA / "lora" / name).keys_total
    assert f"keys_applied={total}/{total}" in report, report
    assert_equals_twin(comfy_sd15, model, new_clip, REALDATA / "lora" / name)


def test_positions_count_in_the_canonical_order_on_comfy_trees(comfy_sd15):
    """ComfyUI's own trees enumerate positions as the twin does: its CLIP (q, k, v registered where
    transformers holds k, v, q) and its ldm UNet (middle before output blocks, where diffusers holds up
    before mid), which the pack resolves on when it has no reference tree for the model."""
    c = import_comfy()
    patcher, clip = comfy_sd15
    twin, keys = meta_twin(), comfy_names(c)
    unet_classes, clip_classes = ("CrossAttention", "Attention", "GEGLU"), ("CLIPAttention",)
    for component, classes, root, prefix in (
        ("unet", unet_classes, patcher.model.diffusion_model, "diffusion_model."),
        ("text_encoder", clip_classes, clip.cond_stage_model, ""),
    ):
        want = [keys[f"{component}.{m}"] for m in AliasTable(twin[component]).positional(classes)]
        got = [f"{prefix}{m}.weight" for m in AliasTable(root).positional(classes)]
        assert len(got) == len(want), (component, len(got), len(want))
        assert got == want, next((i, g, w) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
    # cloneofsimo's trainer walked transformers' CLIPAttention: k_proj first (an independent anchor)
    first = AliasTable(twin["text_encoder"]).positional(clip_classes)[0]
    assert first.endswith("layers.0.self_attn.k_proj"), first


@pytest.mark.parametrize("name", FILES)
def test_without_a_reference_tree_positions_land_where_the_reference_puts_them(comfy_sd15, monkeypatch, name):
    """The pack's fallback (no reference tree for the model: keys resolve on ComfyUI's own ldm names) places
    every position on the module the reference tree does."""
    patcher, _ = comfy_sd15
    adapter = loraweave.load_adapter(REALDATA / "lora" / name)

    def placed() -> dict[str, list[tuple[str, int, int]]]:
        plan = targets.plan_for_patcher(patcher, adapter, strict=True)
        return {pp.part.path: [(q.module, q.dst_start, q.length) for q in pp.pieces] for pp in plan.planned}

    with_reference = placed()
    monkeypatch.setattr(targets, "reference_or_why", lambda _: (None, "no reference (test)"))
    assert placed() == with_reference
