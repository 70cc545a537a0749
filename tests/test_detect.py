"""Architecture detection from key names and shapes on real files; metadata never outvotes the keys."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REALDATA

import loraweave
from loraweave.arch.detect import detect_architecture
from loraweave.cli import main

FILES = {
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors": "sd1",
    "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors": "sd2",
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors": "sd1",
    "timohavdk__sd-lora__2100-lora.safetensors": "sd1",
    "cloneofsimo__lora__analog_svd_rank4.safetensors": "unet",
    "leighwoods__public-loras__lora.safetensors": "flux",
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors": "unet",
}
KEY_LISTS = {
    "flux_lora_kohya_format.json": "flux",
    "flux_lora_diffusers_format.json": "flux",
    "flux_lora_aitoolkit_format.json": "flux",
    "flux_lora_diffusers_base_model_format.json": "flux",
    "anima_lora_peft_format.json": "anima",
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_real_files(name, realdata):
    detection = detect_architecture(loraweave.load_adapter(realdata / "lora" / name))
    assert detection.architecture == FILES[name], detection.evidence
    assert detection.evidence


def test_flux_file_whose_metadata_claims_sd15(realdata):
    detection = detect_architecture(
        loraweave.load_adapter(realdata / "lora" / "leighwoods__public-loras__lora.safetensors")
    )
    assert detection.metadata == {"ss_base_model_version": "sd_1.5"}
    assert any("disagrees; keys win" in e for e in detection.evidence)


@pytest.mark.parametrize("name", sorted(KEY_LISTS))
def test_real_key_lists(name):
    keys = json.loads((REALDATA / "keys" / "invokeai" / name).read_text())["keys"]
    adapter = loraweave.load_adapter({k: torch.empty(v, device="meta") for k, v in keys.items()})
    assert detect_architecture(adapter).architecture == KEY_LISTS[name]


def test_sdxl_by_cross_attention_width():
    header = json.loads(
        (REALDATA / "keys" / "sdxl_lora_diffusers_attnproc__Srikanth1408_header.json").read_text()
    )["keys"]
    adapter = loraweave.load_adapter({k: torch.empty(v["shape"], device="meta") for k, v in header.items()})
    assert detect_architecture(adapter).architecture == "sdxl"


def test_inspect_cli_prints_architecture(capsys, realdata):
    assert (
        main(["inspect", "--json", str(realdata / "lora" / "leighwoods__public-loras__lora.safetensors")])
        == 0
    )
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"]["name"] == "flux" and info["keys_total"] == 8


def _double_stream_only_file(cls_name: str, config: str) -> dict[str, torch.Tensor]:
    """A diffusers-named LoRA on the joint (double-stream) blocks only: names SD3 and Flux share."""
    import diffusers
    from helpers.common import real_config

    with torch.device("meta"):
        model = getattr(diffusers, cls_name).from_config(real_config(config))
    sd = {}
    for name, mod in model.named_modules():
        if name.startswith("transformer_blocks.") and isinstance(mod, torch.nn.Linear):
            sd[f"transformer.{name}.lora_A.weight"] = torch.empty(4, mod.in_features, device="meta")
            sd[f"transformer.{name}.lora_B.weight"] = torch.empty(mod.out_features, 4, device="meta")
    return sd


@pytest.mark.parametrize(
    ("cls_name", "config", "want"),
    [
        ("SD3Transformer2DModel", "sd3-medium__transformer_config.json", "sd3"),
        ("SD3Transformer2DModel", "sd3.5-large__transformer_config.ASSEMBLED.json", "sd3"),
        ("FluxTransformer2DModel", "flux1-dev__transformer_config.json", "flux"),
    ],
)
def test_sd3_and_flux_diffusers_names_told_apart_by_width(cls_name, config, want):
    detection = detect_architecture(loraweave.load_adapter(_double_stream_only_file(cls_name, config)))
    assert detection.architecture == want, detection.evidence
    assert any("hidden width" in e or "dual attention" in e for e in detection.evidence)
