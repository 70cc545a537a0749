"""Per-modality strengths in the ComfyUI pack (issue 41.4): the loader's video/audio/cross strengths on
ComfyUI's LTX-2 (LTXAV), both trees. audio 0 / cross 0 equals loading only the video modules' keys, bit for
bit, merged and at runtime (the forward), the connectors ComfyUI keeps inside its model included; hostile
widget values and modality strengths on a model without modalities are typed errors, nothing cloned.

The test classifies ComfyUI's own module names itself: `audio_to_video_attn` / `video_to_audio_attn` and the
`av_ca_*` modulation cross-modal, any `audio_*` module (tower, `audio_embeddings_connector`) audio, the rest
video (ComfyUI comfy/ldm/lightricks/av_model.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.comfy_arch_cases import CASES, built_case
from helpers.comfy_checks import STRENGTH, all_linears, comfy_modules, merged_state
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted

from loraweave.comfy import load_lora_for_models
from loraweave.errors import ArgumentError


def _modality(name: str) -> str:
    if "audio_to_video_attn" in name or "video_to_audio_attn" in name or name.startswith("av_ca_"):
        return "cross"
    return "audio" if any(p.startswith("audio_") for p in name.split(".")) else "video"


@pytest.fixture(scope="module")
def models():
    return {}


def _file(m):
    linears = all_linears(comfy_modules(m))
    sd = adapter_file(linears, "lora", dotted("diffusion_model."))
    names = {f"diffusion_model.{n}": n for n in linears}
    assert {_modality(n) for n in linears} == {"video", "audio", "cross"}
    return sd, names


def _stem(key: str) -> str:
    for suffix in (".lora_up.weight", ".lora_down.weight", ".alpha"):
        key = key.removesuffix(suffix)
    return key


def _only_video(sd, names):
    return {k: v for k, v in sd.items() if _modality(names[_stem(k)]) == "video"}


def test_audio_0_cross_0_merged_equals_the_video_keys_alone(models):
    m = built_case(models, "ltx2")
    sd, names = _file(m)
    wanted = {"video": 1.0, "audio": 0.0, "cross": 0.0}
    scaled, _, report = load_lora_for_models(
        m.patcher, None, sd, STRENGTH, 0.0, "merge", modality_strengths=wanted
    )
    alone, _, _ = load_lora_for_models(m.patcher, None, _only_video(sd, names), STRENGTH, 0.0, "merge")
    a, b = merged_state(scaled), merged_state(alone)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    notes = {row.module: row.notes for row in report.applied}
    assert any("modality audio x0" in n for n in notes.values())
    assert any("modality cross x0" in n for n in notes.values())
    assert any("modality video x1" in n for n in notes.values())
    assert any("embeddings_connector" in k for k in notes)  # ComfyUI-only modules are scaled too


def test_audio_0_runtime_forward_equals_the_video_and_cross_keys(models):
    c = import_comfy()
    m, case = built_case(models, "ltx2"), CASES["ltx2"]
    sd, names = _file(m)
    kept = {k: v for k, v in sd.items() if _modality(names[_stem(k)]) != "audio"}
    outputs = []
    for file, wanted in ((sd, {"audio": 0.0}), (kept, None)):
        model, _, _ = load_lora_for_models(
            m.patcher, None, file, STRENGTH, 0.0, "runtime", modality_strengths=wanted
        )
        c.model_management.load_models_gpu([model])
        with torch.no_grad():
            outputs.append(case.forward(model.model.diffusion_model))
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)
    assert torch.equal(outputs[0], outputs[1])


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"audio": math.nan}, "audio"),
        ({"speech": 0.0}, "unknown modality 'speech'"),
        ({"video": 1e9}, "video"),
    ],
)
def test_hostile_modality_strengths_are_typed(models, value, words):
    m = built_case(models, "ltx2")
    with pytest.raises(ArgumentError, match=words):
        load_lora_for_models(m.patcher, None, _file(m)[0], 1.0, 0.0, "merge", modality_strengths=value)


def test_loader_node_passes_its_widgets(models):
    from loraweave.comfy.nodes import load_one
    from loraweave.resolve.modality import modality_request

    assert modality_request(1.0, 1.0, 1.0) is None  # defaults ask nothing: any model takes the file
    with pytest.raises(ArgumentError, match="audio_strength"):
        modality_request(1.0, math.inf, 1.0)
    assert load_one.__defaults__[-1] == (1.0, 1.0, 1.0)


def test_modality_strengths_on_a_model_without_modalities_refuse(models):
    m = built_case(models, "anima")
    linears = all_linears(comfy_modules(m))
    sd = adapter_file(linears, "lora", dotted("diffusion_model."))
    with pytest.raises(ArgumentError, match="has no modalities"):
        load_lora_for_models(m.patcher, None, sd, 1.0, 0.0, "merge", modality_strengths={"audio": 0.0})
