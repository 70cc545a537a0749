"""Real adapter files and real key lists resolve 100% against full-size models built on the meta device."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import REALDATA
from helpers.common import real_config, reason_prefixes
from helpers.real_files import REAL_FILES

import loraweave

LORA_DIR = REALDATA / "lora"
KEYS = REALDATA / "keys"


@pytest.fixture(scope="module")
def meta_models(realdata):
    from diffusers import FluxTransformer2DModel, UNet2DConditionModel, ZImageTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    sd2 = real_config("sd15__unet_config.json")
    # No SD2 UNet config is in the shared data; SD2 differs from SD1.5 in exactly these fields.
    sd2.update(cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20], use_linear_projection=True)
    with torch.device("meta"):
        return {
            "sd15_unet": UNet2DConditionModel.from_config(real_config("sd15__unet_config.json")),
            "sd2_unet": UNet2DConditionModel.from_config(sd2),
            "sdxl_unet": UNet2DConditionModel.from_config(real_config("sdxl-base__unet_config.json")),
            "sd15_te": CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json"))),
            "flux": FluxTransformer2DModel.from_config(real_config("flux1-dev__transformer_config.json")),
            "zimage": ZImageTransformer2DModel.from_config(
                real_config("z-image-turbo__transformer_config.json")
            ),
        }


def _target(kind: str, models: dict):
    if kind == "flux":
        return {"transformer": models["flux"]}
    return {"unet": models[f"{kind}_unet"], "text_encoder": models["sd15_te"]}


def test_every_real_file_is_listed():
    found = {p.name for p in LORA_DIR.glob("*.safetensors")}
    assert found == set(REAL_FILES), "update REAL_FILES when ../shared/realdata/lora changes"


@pytest.mark.parametrize("name", sorted(REAL_FILES))
def test_real_file_parses_and_resolves(name, meta_models):
    kind, families, reasons = REAL_FILES[name]
    adapter = loraweave.load_adapter(LORA_DIR / name)
    assert adapter.unparsed == []
    assert adapter.families == families
    report = loraweave.plan(_target(kind, meta_models), adapter)
    assert reason_prefixes(report) == reasons, report.unmatched[:3]
    assert report.keys_applied + len(report.unmatched) == report.keys_total == adapter.keys_total
    for miss in report.unmatched:  # unsupported parts still name the module they would land on
        assert "target " in miss["reason"]
    json.dumps(report.to_dict())


def test_cloneofsimo_positions_follow_the_trainer_order(meta_models):
    """Index i is the i-th Linear under the trainer's target classes; shapes prove the order (q/k/v in attn2
    take 768-wide text input, GEGLU proj has 8x rows)."""
    report = loraweave.plan(
        _target("sd15", meta_models), LORA_DIR / "cloneofsimo__lora__analog_svd_rank4.safetensors"
    )
    modules = {m.module for m in report.applied}
    assert len(modules) == 192
    assert "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj" in modules


def _invoke_keys(name: str) -> dict[str, torch.Tensor]:
    keys = json.loads((KEYS / "invokeai" / name).read_text())["keys"]
    return {k: torch.empty(shape, device="meta") for k, shape in keys.items()}


@pytest.mark.parametrize(
    "name",
    [
        "flux_lora_kohya_format.json",
        "flux_lora_diffusers_format.json",
        "flux_lora_aitoolkit_format.json",
        "flux_lora_diffusers_base_model_format.json",
        "flux_lora_diffusers_with_norm_out_format.json",
    ],
)
def test_invokeai_flux_key_lists_resolve_fully(name, meta_models):
    report = loraweave.plan(meta_models["flux"], _invoke_keys(name))
    assert report.unmatched == []
    assert report.keys_applied == report.keys_total > 400


def test_flux_bfl_lokr_list_resolves_to_modules(meta_models):
    """InvokeAI's BFL LoKr sample has synthetic shapes (kron gives 1024 rows for 3072-row targets): every key
    must still reach its module and be reported as a shape mismatch naming the target."""
    report = loraweave.plan(meta_models["flux"], _invoke_keys("flux_lokr_bfl_format.json"))
    assert set(reason_prefixes(report)) == {"shape mismatch"}
    assert all("transformer_blocks" in u["reason"] for u in report.unmatched)


def test_sdxl_attn_processor_header_resolves(meta_models):
    header = json.loads((KEYS / "sdxl_lora_diffusers_attnproc__Srikanth1408_header.json").read_text())["keys"]
    sd = {k: torch.empty(v["shape"], device="meta") for k, v in header.items()}
    report = loraweave.plan({"unet": meta_models["sdxl_unet"]}, sd)
    assert report.unmatched == [] and report.keys_total == 1120


def _mecha_weights(name: str, component: str) -> dict[str, list[int]]:
    """Weight keys and shapes of one component of an sd-mecha model-config yaml (simple line format)."""
    out, inside = {}, False
    for line in (KEYS / "sd-mecha" / name).read_text().splitlines():
        if re.match(r"^  \S+:$", line):
            inside = line.strip() == f"{component}:"
        m = re.match(r"^    (\S+)\.weight: \{shape: \[([\d, ]+)\]", line)
        if inside and m:
            out[m[1]] = [int(x) for x in m[2].split(",")]
    return out


def _lora_on_every_weight(weights: dict[str, list[int]], layout: str) -> dict[str, torch.Tensor]:
    """A rank-4 meta LoRA on every 2-D/4-D weight of an original checkpoint, kohya or ComfyUI spelling."""
    sd = {}
    for key, shape in weights.items():
        if len(shape) < 2:
            continue
        path = key.removeprefix("model.diffusion_model.")
        stem = "lora_unet_" + path.replace(".", "_") if layout == "kohya" else f"diffusion_model.{path}"
        sd[f"{stem}.lora_down.weight"] = torch.empty([4, *shape[1:]], device="meta")
        sd[f"{stem}.lora_up.weight"] = torch.empty([shape[0], 4] + [1] * (len(shape) - 2), device="meta")
    return sd


@pytest.mark.parametrize("layout", ["kohya", "comfyui"])
def test_sdxl_original_names_resolve(layout, meta_models):
    """A LoRA on every 2-D/4-D weight of the real SDXL sgm checkpoint, in kohya and ComfyUI spellings."""
    weights = _mecha_weights("sdxl-sgm.yaml", "diffuser")
    assert len(weights) > 500
    sd = _lora_on_every_weight(weights, layout)
    report = loraweave.plan({"unet": meta_models["sdxl_unet"]}, sd)
    assert report.unmatched == []
    assert report.keys_applied == len(sd)


def test_zimage_original_names_resolve(meta_models):
    """Every 2-D weight of the real Z-Image ComfyUI checkpoint subset, as a `diffusion_model.` LoRA."""
    keys = json.loads(
        (KEYS / "invokeai" / "z_image_transformer_comfyui_keys__base_model_subset.json").read_text()
    )["keys"]
    sd = {}
    for key, shape in keys.items():
        if key.endswith(".weight") and len(shape) == 2:
            stem = "diffusion_model." + key.removesuffix(".weight")
            sd[f"{stem}.lora_A.weight"] = torch.empty([4, shape[1]], device="meta")
            sd[f"{stem}.lora_B.weight"] = torch.empty([shape[0], 4], device="meta")
    report = loraweave.plan(meta_models["zimage"], sd)
    assert report.unmatched == []
    qkv = [m for m in report.applied if ".attention.to_" in m.module and m.module.startswith("layers.0.")]
    assert len(qkv) == 4  # fused qkv split onto to_q/to_k/to_v, plus `out` onto to_out.0
    assert report.keys_applied == len(sd)


@pytest.mark.parametrize(
    "yaml_name, config, cls",
    [
        ("sd3-comfyui.yaml", "sd3-medium__transformer_config.json", "SD3Transformer2DModel"),
        ("flux-flux.yaml", "flux1-dev__transformer_config.json", "FluxTransformer2DModel"),
    ],
)
@pytest.mark.parametrize("layout", ["kohya", "comfyui"])
def test_dit_original_checkpoint_names_resolve(yaml_name, config, cls, layout):
    """A LoRA on every 2-D/4-D weight of a real original (ComfyUI/BFL) checkpoint resolves on the diffusers
    model."""
    import diffusers

    weights = _mecha_weights(yaml_name, "diffuser")
    assert len(weights) > 200
    with torch.device("meta"):
        model = getattr(diffusers, cls).from_config(real_config(config))
    sd = _lora_on_every_weight(weights, layout)
    report = loraweave.plan(model, sd)
    assert report.unmatched == [], report.unmatched[:3]
    assert report.keys_applied == len(sd)


def test_qwen_image_key_list_resolves(realdata):
    import diffusers

    with torch.device("meta"):
        model = diffusers.QwenImageTransformer2DModel.from_config(
            real_config("qwen-image__transformer_config.json")
        )
    report = loraweave.plan(model, _invoke_keys("qwen_image_lora_diffusers_format.json"))
    assert report.unmatched == [] and report.keys_applied == report.keys_total > 0


WAN_NAMES = {  # hand-written from diffusers' Wan converter: original -> diffusers module
    "self_attn": "attn1",
    "cross_attn": "attn2",
    "q": "to_q",
    "k": "to_k",
    "v": "to_v",
    "o": "to_out.0",
    "k_img": "add_k_proj",
    "v_img": "add_v_proj",
}


@pytest.mark.parametrize("variant", ["Wan-T2V-14B", "Wan-I2V-14B-480p"])
def test_wan_original_names_resolve_on_full_size_models(variant):
    """musubi (kohya) Wan names on the real full-size configs; I2V-only keys are reported on T2V, never
    dropped."""
    import diffusers

    cfg = json.loads((REALDATA / "configs" / "wan__diffusers_transformer_configs.json").read_text())[variant]
    with torch.device("meta"):
        model = diffusers.WanTransformer3DModel.from_config(cfg["diffusers_config"])
    modules = dict(model.named_modules())
    pairs = {}
    for i in (0, 39):
        for attn in ("self_attn", "cross_attn"):
            for p in ("q", "k", "v", "o", *(("k_img", "v_img") if attn == "cross_attn" else ())):
                pairs[f"blocks.{i}.{attn}.{p}"] = f"blocks.{i}.{WAN_NAMES[attn]}.{WAN_NAMES[p]}"
        pairs[f"blocks.{i}.ffn.0"] = f"blocks.{i}.ffn.net.0.proj"
        pairs[f"blocks.{i}.ffn.2"] = f"blocks.{i}.ffn.net.2"
    pairs.update(
        {
            "head.head": "proj_out",
            "text_embedding.0": "condition_embedder.text_embedder.linear_1",
            "time_embedding.2": "condition_embedder.time_embedder.linear_2",
        }
    )
    sd = {}
    for original, diffusers_name in pairs.items():
        # T2V lacks the image projections: give those keys the shape of the text ones.
        w = modules.get(
            diffusers_name,
            modules[diffusers_name.replace("add_k_proj", "to_k").replace("add_v_proj", "to_v")],
        ).weight
        stem = "lora_unet_" + original.replace(".", "_")
        sd[f"{stem}.lora_down.weight"] = torch.empty(4, w.shape[1], device="meta")
        sd[f"{stem}.lora_up.weight"] = torch.empty(w.shape[0], 4, device="meta")
    report = loraweave.plan(model, sd)
    img_keys = {k for k in sd if "_img" in k}
    if variant.startswith("Wan-I2V"):
        assert report.unmatched == [] and report.keys_applied == len(sd)
    else:
        assert {u["key"] for u in report.unmatched} == img_keys
        assert all(
            u["reason"].startswith("expected absent:") and u["kind"] == "expected_absent"
            for u in report.unmatched
        )
