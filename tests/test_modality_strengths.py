"""Per-modality strengths (issue 41.4): audio-video models train one file over both towers (LTX-2/2.3,
MiniMax-H3); users ask for a separate audio strength (kijai/ComfyUI-KJNodes #606, #745).

Acceptance: audio 0 / video 1 (cross-modal 0) equals applying only the video modules' keys, bit for bit;
audio 0 alone equals the video and cross-modal keys; a fractional audio strength is the fp64 formula W + s·B·A
on the audio modules. The test classifies modules by its own reading of diffusers' LTX2VideoTransformer3DModel
(`audio_*` tower, `audio_to_video_attn` / `video_to_audio_attn` and the `av_cross_attn_*` modulation
cross-modal) and MiniMaxH3Transformer3DModel's docstring (one joint stream: only `audio_proj_in/out` are
audio, `proj_in/out` video), not by the arch record. Key lists: LTX-2 original names as
`_convert_non_diffusers_ltx2_lora_to_diffusers` reads them (helpers.arch_layouts.ltx2_original).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.arch_layouts import linears, lora_file, ltx2_original
from helpers.tiny_configs import ANIMA_DIT_TINY, LTX2_TINY

import loraweave
from loraweave import AdapterSpec
from loraweave.errors import ArgumentError, PromptAdapterError
from loraweave.request.prompt import parse_prompt

H3_TINY = dict(
    num_attention_heads=2,
    attention_head_dim=128,
    hidden_size=32,
    num_layers=2,
    num_refiner_layers=1,
    ffn_dim=16,
    in_channels=4,
    audio_in_channels=4,
    text_dim=24,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
)


def _ltx_modality(live: str) -> str:
    if "audio_to_video_attn" in live or "video_to_audio_attn" in live or live.startswith("av_cross_attn_"):
        return "cross"
    return "audio" if any(p.startswith("audio_") for p in live.split(".")) else "video"


def _h3_modality(live: str) -> str:
    return {"audio_proj_in": "audio", "audio_proj_out": "audio", "proj_in": "video", "proj_out": "video"}.get(
        live, "cross"
    )


def _model(cls: str, config: dict) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    return getattr(diffusers, cls)(**config).double().eval()


CASES = {
    "ltx2": (
        "LTX2VideoTransformer3DModel",
        LTX2_TINY,
        _ltx_modality,
        lambda n: f"diffusion_model.{ltx2_original(n)}",
    ),
    "minimax-h3": ("MiniMaxH3Transformer3DModel", H3_TINY, _h3_modality, lambda n: f"transformer.{n}"),
}


def _setup(arch: str):
    cls, config, modality_of, name_of = CASES[arch]
    model = _model(cls, config)
    mods = linears(model)
    sd = {k: v.double() for k, v in lora_file(mods, name_of).items()}
    stems = {name_of(n): n for n in mods}
    return cls, config, modality_of, sd, stems, model


def _only(sd: dict, stems: dict, keep) -> dict:
    return {k: v for k, v in sd.items() if keep(stems[k.rsplit(".", 2)[0]])}


@pytest.mark.parametrize("arch", list(CASES))
def test_audio_0_video_1_equals_the_video_keys_alone(arch):
    cls, config, modality_of, sd, stems, model = _setup(arch)
    assert {modality_of(stems[s]) for s in stems} == {"video", "audio", "cross"}
    reference = _model(cls, config)
    loraweave.apply(reference, _only(sd, stems, lambda n: modality_of(n) == "video"), mode="merge")
    handle = loraweave.apply(
        model,
        AdapterSpec(sd, modality_strengths={"video": 1.0, "audio": 0.0, "cross": 0.0}),
        mode="merge",
        strict=True,
    )
    after = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(after[key], value), key
    # the report says which modules were scaled by what
    notes = {row.module: row.notes for row in handle.report.applied}
    for live in stems.values():
        want = f"modality {modality_of(live)} x{ {'video': 1, 'audio': 0, 'cross': 0}[modality_of(live)] }"
        assert want in notes[live], (live, notes[live])

    # audio 0 alone: the cross-modal modules stay at 1
    reference = _model(cls, config)
    loraweave.apply(reference, _only(sd, stems, lambda n: modality_of(n) != "audio"), mode="merge")
    model = _model(cls, config)
    loraweave.apply(model, AdapterSpec(sd, modality_strengths={"audio": 0.0}), mode="merge")
    after = model.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(after[key], value), key


def test_fractional_audio_strength_is_the_fp64_formula():
    cls, config, modality_of, sd, stems, model = _setup("ltx2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loraweave.apply(model, AdapterSpec(sd, strength=0.8, modality_strengths={"audio": 0.25}), mode="merge")
    after = model.state_dict()
    for stem, live in stems.items():
        scale = 0.8 * (0.25 if modality_of(live) == "audio" else 1.0)
        expected = (
            before[f"{live}.weight"] + scale * sd[f"{stem}.lora_B.weight"] @ sd[f"{stem}.lora_A.weight"]
        )
        torch.testing.assert_close(after[f"{live}.weight"], expected, rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"audio": math.nan}, "modality_strengths\\['audio'\\]"),
        ({"video": math.inf}, "modality_strengths\\['video'\\]"),
        ({"audio": 1e9}, "modality_strengths\\['audio'\\]"),
        ({"audio": "0.5"}, "modality_strengths\\['audio'\\]"),
        ({"audio": True}, "modality_strengths\\['audio'\\]"),
        ({"speech": 0.0}, "unknown modality 'speech'"),
        ([0.0, 1.0], "modality_strengths must map"),
    ],
)
def test_hostile_modality_strengths_name_the_field(value, words):
    with pytest.raises(ArgumentError, match=words):
        AdapterSpec("x.safetensors", modality_strengths=value)


def test_modality_strengths_on_a_model_without_modalities_refuse_unchanged():
    model = _model("CosmosTransformer3DModel", ANIMA_DIT_TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = {k: v.double() for k, v in lora_file(linears(model), lambda n: f"transformer.{n}").items()}
    with pytest.raises(ArgumentError, match="modality_strengths .*has no modalities"):
        loraweave.apply(model, AdapterSpec(sd, modality_strengths={"audio": 0.0}), mode="merge")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_prompt_tag_takes_modality_strengths(tmp_path):
    (tmp_path / "av.safetensors").write_bytes(b"")
    _, (spec,) = parse_prompt("a cat <lora:av:0.9:audio=0:cross=0.5>", tmp_path)
    assert spec.strength == 0.9 and spec.modality_strengths == {"audio": 0.0, "cross": 0.5}
    _, (plain,) = parse_prompt("<lora:av:1>", tmp_path)
    assert plain.modality_strengths is None
    for bad in ("audio=nan", "audio=x", "video=1e9", "audio=1:audio=2"):
        with pytest.raises(PromptAdapterError, match="audio=|video="):
            parse_prompt(f"<lora:av:1:{bad}>", tmp_path)


def test_cli_modality_option_and_generate_requests(tmp_path):
    import argparse

    from loraweave.cli.support import modality_arg
    from loraweave.tools.generate import GenerateRequest, adapter_specs

    assert modality_arg("Audio=0") == ("audio", 0.0)
    for bad in ("speech=1", "audio", "audio=nan", "audio=inf", "video=1e9", "cross=x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--modality"):
            modality_arg(bad)
    for name in ("av", "own"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"")
    req = GenerateRequest(
        model="m",
        prompt="<lora:av:1> <lora:own:1:audio=0.5>",
        lora_dir=str(tmp_path),
        loras=[(str(tmp_path / "av.safetensors"), 0.7)],
        modality_strengths={"audio": 0.0},
    )
    _, specs = adapter_specs(req)
    assert [s.modality_strengths for s in specs] == [{"audio": 0.0}, {"audio": 0.5}, {"audio": 0.0}]
