"""A file for another architecture is refused by `loraweave.apply` (issue 43 B/E), through the engine's one
decision (engine/decide.py `check_arch`): the real SD2 file `JustinJiangNext__lora-2.0` on the diffusers SD1.5
UNet (full size, on `meta`: the refusal comes before anything is computed) lands 192 of its 256 keys, and
`inspect` says sd2. `allow_other_arch=True` applies it and says so (report, summary, WARNING). Files of the
model's own architecture, files detection cannot place (LyCORIS LoKr without a cross-attention factor,
cloneofsimo positions, text-encoder-only files) and the variants of one architecture (Flux dev/schnell,
Chroma, Flux.2 klein, LTX-2/2.3 in one ComfyUI class) are not refused. `Handle.switch` (how Ray Serve loads
adapters) refuses as apply does, keeping the handle's set, and takes the same opt-in."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from conftest import REALDATA
from helpers.common import real_config

import loraweave
from loraweave.arch.fit import file_arch, model_arch, module_arch
from loraweave.cli.support import cli_words
from loraweave.errors import NoKeysLandedError, WrongArchitectureError

LORA_DIR = REALDATA / "lora"
SD2_FILE = "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"
FLUX_FILE = "leighwoods__public-loras__lora.safetensors"
SD1_FILES = (
    "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors",
    "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr.safetensors",
    "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors",
    "Haseebae__Synthetic_dataset_generator_with_stable_diffusion__pytorch_lora_weights.safetensors",
    "cloneofsimo__lora__analog_svd_rank4.safetensors",
    "timohavdk__sd-lora__2100-lora.safetensors",
)


def _meta(cls_name: str, config: dict) -> torch.nn.Module:
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, cls_name).from_config(config)


@pytest.fixture(scope="module")
def sd15(realdata):
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        te = CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json")))
    return {"unet": _meta("UNet2DConditionModel", real_config("sd15__unet_config.json")), "text_encoder": te}


def _sd2_config() -> dict:
    config = real_config("sd15__unet_config.json")  # SD2 differs from SD1.5 in exactly these fields
    config.update(cross_attention_dim=1024, attention_head_dim=[5, 10, 20, 20], use_linear_projection=True)
    return config


def _hooks(model: dict) -> list:
    return [
        (name, len(m._forward_hooks), len(m._forward_pre_hooks), type(m).__name__)
        for component in model.values()
        for name, m in component.named_modules()
    ]


def test_sd2_file_on_the_sd15_unet_is_refused_in_users_terms(sd15):
    before = _hooks(sd15)
    with pytest.raises(WrongArchitectureError) as caught:
        loraweave.apply(sd15, LORA_DIR / SD2_FILE, mode="runtime")
    message = str(caught.value)
    assert message.startswith(f"{SD2_FILE}: an SD2 LoRA on an SD1.5 model."), message
    assert "pass allow_other_arch=True to apply it anyway" in message and "allow_empty" not in message
    assert caught.value.found == [
        {
            "adapter": SD2_FILE,
            "file_arch": "sd2",
            "model_arch": "sd1",
            "words": "an SD2 LoRA on an SD1.5 model",
        }
    ]
    assert _hooks(sd15) == before
    # The CLI says its own flag for the same message.
    assert "pass --allow-other-arch to apply it anyway" in cli_words(message)


def test_a_flux_file_on_sd15_is_named_so_not_by_modules(sd15):
    """Item E: the wording a user reads is "a Flux LoRA on an SD1.5 model" (it was a module-by-module
    NoKeysLandedError ending in allow_empty=True)."""
    with pytest.raises(WrongArchitectureError) as caught:
        loraweave.apply(sd15, LORA_DIR / FLUX_FILE, mode="runtime")
    assert str(caught.value).startswith(f"{FLUX_FILE}: a Flux LoRA on an SD1.5 model."), str(caught.value)


def test_the_opt_in_applies_and_says_so(sd15, caplog):
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        handle = loraweave.apply(sd15, LORA_DIR / SD2_FILE, mode="runtime", allow_other_arch=True)
    try:
        report = handle.report
        assert (report.keys_applied, report.keys_total) == (192, 256)  # attn2.to_k/to_v (1024 wide) miss
        assert report.other_arch == [
            {
                "adapter": SD2_FILE,
                "file_arch": "sd2",
                "model_arch": "sd1",
                "words": "an SD2 LoRA on an SD1.5 model",
            }
        ]
        assert report.summary().startswith("other_arch=sd2_on_sd1 ")
        assert report.to_dict()["other_arch"] == report.other_arch
        assert report.other_arch_lines() == [
            f"{SD2_FILE}: an SD2 LoRA on an SD1.5 model, applied anyway (allow_other_arch)"
        ]
        warned = [r for r in caplog.records if "other_arch" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert "an SD2 LoRA on an SD1.5 model, applied anyway" in warned[0].getMessage()
    finally:
        handle.remove()


@pytest.mark.parametrize("name", SD1_FILES)
def test_sd1_files_on_the_sd15_pipeline_are_not_refused(sd15, name, caplog):
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        handle = loraweave.apply(sd15, LORA_DIR / name, mode="runtime")
    try:
        assert handle.report.keys_applied == handle.report.keys_total and handle.report.other_arch == []
        assert "other_arch" not in caplog.text
    finally:
        handle.remove()


def test_the_sd2_file_on_an_sd2_unet_is_not_refused(realdata):
    handle = loraweave.apply(
        _meta("UNet2DConditionModel", _sd2_config()), LORA_DIR / SD2_FILE, mode="runtime"
    )
    try:
        assert handle.report.keys_applied == 256 and handle.report.other_arch == []
    finally:
        handle.remove()


@pytest.mark.parametrize(
    "cls, config",
    [
        ("FluxTransformer2DModel", "flux1-dev__transformer_config.json"),
        ("FluxTransformer2DModel", "flux1-schnell__transformer_config.json"),
        ("ChromaTransformer2DModel", "chroma__transformer_config.json"),  # Flux LoRAs are applied to it
    ],
)
def test_the_flux_file_on_flux_variants_is_not_refused(realdata, cls, config):
    model = _meta(cls, real_config(config))
    handle = loraweave.apply(model, LORA_DIR / FLUX_FILE, mode="runtime")
    try:
        assert handle.report.keys_applied == 8 and handle.report.other_arch == []
    finally:
        handle.remove()


def _lora(stem: str, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
    return {
        f"{stem}.lora_down.weight": torch.zeros(2, in_features),
        f"{stem}.lora_up.weight": torch.zeros(out_features, 2),
    }


def test_what_detection_cannot_place_says_nothing():
    """Files whose keys name no one model are never refused: text-encoder only, a UNet file without a
    cross-attention factor; Flux-named blocks that Flux.1 and Flux.2 klein both have may be either."""
    te_only = _lora("lora_te_text_model_encoder_layers_0_self_attn_q_proj", 768, 768)
    unet = _lora("lora_unet_down_blocks_0_attentions_0_proj_in", 320, 320)
    klein_or_flux1 = _lora("lora_unet_double_blocks_0_img_attn_proj", 3072, 3072)
    assert [file_arch(loraweave.load_adapter(sd)) for sd in (te_only, unet)] == [None, None]
    assert {"flux", "flux2"} <= file_arch(loraweave.load_adapter(klein_or_flux1)).possible
    # a 19th double block: only Flux.1 has it
    flux1 = file_arch(
        loraweave.load_adapter({**_lora("lora_unet_double_blocks_18_img_attn_proj", 3072, 3072)})
    )
    assert flux1.name == "flux" and "flux2" not in flux1.possible


def test_shared_names_keep_every_owner_possible():
    """An attention-only Qwen-Image LoRA (diffusers names, 3072 wide) reads as Flux by its width; the names
    are MMDiT names Qwen-Image owns, so a Qwen-Image model takes it."""
    # block 10: past Flux.2 klein's 5 double blocks, so only the width speaks
    stems = [f"transformer.transformer_blocks.10.attn.{m}" for m in ("to_q", "to_k", "add_q_proj")]
    tensors = {}
    for stem in stems:
        tensors[f"{stem}.lora_A.weight"] = torch.zeros(2, 3072)
        tensors[f"{stem}.lora_B.weight"] = torch.zeros(3072, 2)
    found = file_arch(loraweave.load_adapter(tensors))
    assert found is not None and found.name == "flux" and "qwen-image" in found.possible
    assert found.possible & model_arch("qwen-image").takes


def test_model_facts_of_variants():
    """ComfyUI classes that hold several releases, and derived models, take their relatives' files."""
    assert {"flux", "flux-schnell"} <= model_arch("flux-schnell").takes
    assert "flux" in model_arch("chroma").takes
    assert "ltx2.3" in model_arch("ltx2").takes  # ComfyUI's LTXAV holds LTX-2 and LTX-2.3
    assert {"flux2-klein-4b", "flux2-klein-9b"} <= model_arch("flux2").takes
    assert model_arch("sd1").takes == {"sd1"} and model_arch("sdxl").takes == {"sdxl"}
    assert model_arch(None) is None and model_arch("no-such-arch") is None


def test_unet_models_are_told_apart_by_their_cross_attention_width(realdata):
    assert module_arch(_meta("UNet2DConditionModel", real_config("sd15__unet_config.json"))).name == "sd1"
    assert module_arch(_meta("UNet2DConditionModel", _sd2_config())).name == "sd2"
    sdxl = _meta("UNet2DConditionModel", real_config("sdxl-base__unet_config.json"))
    assert module_arch(sdxl).name == "sdxl"
    refiner = _meta("UNet2DConditionModel", real_config("sdxl-refiner__unet_config.json"))
    assert module_arch(refiner).name == "sdxl-refiner"
    tiny = _meta(
        "UNet2DConditionModel",
        {
            "block_out_channels": [32, 64],
            "cross_attention_dim": 32,
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
            "layers_per_block": 1,
            "norm_num_groups": 8,
        },
    )
    assert module_arch(tiny) is None  # a width no release has: no fact, no refusal


def test_nothing_landed_of_an_unplaced_file_stays_the_empty_refusal(sd15):
    """A file whose architecture detection cannot name still gets NoKeysLandedError, with apply's opt-in."""
    with pytest.raises(NoKeysLandedError) as caught:
        loraweave.apply(sd15, _lora("lora_unet_no_such_layer", 8, 8))
    assert "Pass allow_empty=True to apply anyway" in str(caught.value)


def test_the_readme_says_when_the_pack_refuses_a_wrong_file():
    """Item E: the README called a wrong-architecture file an error at queue time; it fails when the node
    runs (ComfyUI validates only the inputs at queue time), and the node's opt-in is named."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "(a wrong-architecture LoRA) is an error at queue time" not in readme
    comfy = readme[readme.index("Queue time (before anything runs)") :][:900]
    assert "is an error when the node runs" in comfy and "`allow_other_arch` input" in comfy, comfy


def _params(model: dict) -> list:
    return [(c, n, p) for c, m in model.items() for n, p in m.named_parameters()]


def test_a_switch_to_another_architecture_is_refused_and_keeps_the_set(sd15):
    """Handle.switch (what Ray Serve loads adapters through) runs apply's architecture check: the SD2 file is
    refused before anything changes, and the handle keeps its SD1.5 file, usable for a later switch."""
    sd1, clean = LORA_DIR / SD1_FILES[2], _hooks(sd15)
    handle = loraweave.apply(sd15, sd1, mode="runtime")
    try:
        hooks, params, report = _hooks(sd15), _params(sd15), handle.report.to_dict()
        with pytest.raises(WrongArchitectureError) as caught:
            handle.switch([LORA_DIR / SD2_FILE])
        assert str(caught.value).startswith(f"{SD2_FILE}: an SD2 LoRA on an SD1.5 model."), str(caught.value)
        assert _hooks(sd15) == hooks and handle.report.to_dict() == report
        assert all(a is b for (*_, a), (*_, b) in zip(_params(sd15), params, strict=True))
        assert handle.active and [a["path"] for a in handle.report.adapters] == [str(sd1)]
        handle.switch([LORA_DIR / SD1_FILES[3]])  # still usable
        assert handle.report.keys_applied == handle.report.keys_total and handle.report.other_arch == []
    finally:
        handle.remove()
    assert _hooks(sd15) == clean


def test_a_switch_with_the_opt_in_applies_and_says_so(sd15):
    handle = loraweave.apply(sd15, LORA_DIR / SD1_FILES[2], mode="runtime")
    try:
        handle.switch([LORA_DIR / SD2_FILE], allow_other_arch=True)
        report = handle.report
        assert (report.keys_applied, report.keys_total) == (192, 256)
        assert [o["words"] for o in report.other_arch] == ["an SD2 LoRA on an SD1.5 model"]
        assert report.summary().startswith("other_arch=sd2_on_sd1 ")
        handle.switch([LORA_DIR / SD1_FILES[2]])  # back to its own architecture: nothing to say
        assert handle.report.other_arch == []
    finally:
        handle.remove()
