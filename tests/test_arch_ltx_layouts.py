"""New layouts and original-name tables, each against diffusers' own converter (+ PEFT for the numbers).

Per layout/architecture:
1. the converter is the oracle for names: every original name of a converter-derived key list must land on the
   module the converter maps it to (on the full-size meta model: 100 %, nothing else);
2. merged and runtime outputs of every Linear equal diffusers' converter + PEFT (`load_lora_adapter`) on a tiny
   model of the class (fp32, 1e-5 relative);
3. negative controls: a swapped table row makes (1) fail.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from helpers import rel_err

import loraweave
from loraweave.arch import aliases as arch_aliases
from loraweave.arch.aliases import AliasTable

LTX2_FULL = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True)
LTX2_TINY = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                 audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=4,
                 audio_cross_attention_dim=8, num_layers=2, caption_channels=12, **LTX2_FULL)


def linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}


def ltx2_original(live: str) -> str:
    """Write a live LTX-2 name the way the original checkpoint does (the test's own inverse of the renames)."""
    for new, old in (("prompt_adaln", "prompt_adaln_single"), ("norm_k", "k_norm"), ("norm_q", "q_norm"),
                     ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
                     ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
                     ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
                     ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
                     ("proj_in", "patchify_proj")):
        live = live.replace(new, old)
    for new, old in (("time_embed.", "adaln_single."), ("audio_time_embed.", "audio_adaln_single.")):
        if live.startswith(new):
            live = old + live[len(new):]
    return live


def lora_file(modules: dict[str, torch.nn.Module], name_of, rank: int = 2, seed: int = 4, meta: bool = False):
    """{file key: tensor}: a LoRA on every module, named by `name_of(live name)`; no alpha (scale 1, as PEFT)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for live, m in modules.items():
        out, inp = m.weight.shape
        stem = name_of(live)
        if meta:
            sd[f"{stem}.lora_A.weight"] = torch.empty(rank, inp, device="meta")
            sd[f"{stem}.lora_B.weight"] = torch.empty(out, rank, device="meta")
        else:
            sd[f"{stem}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
            sd[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1
    return sd


def converter_targets(convert, sd: dict, prefix: str = "transformer.") -> dict[str, str]:
    """{file stem: live module} as diffusers' converter maps them (one key at a time)."""
    out = {}
    for key in sd:
        if key.endswith(".lora_A.weight"):
            (converted,) = convert({key: sd[key]})
            out[key.removesuffix(".lora_A.weight")] = converted.removeprefix(prefix).removesuffix(".lora_A.weight")
    return out


def assert_lands_where_the_converter_says(model, sd: dict, targets: dict[str, str]):
    report = loraweave.plan(model, sd)
    assert report.unmatched == [] and report.keys_applied == report.keys_total == len(sd)
    table = AliasTable(model)
    wrong = {stem: (found, live) for stem, live in targets.items()
             if (found := [p.module for p in table.lookup(stem.split(".", 1)[1])]) != [live]}
    assert not wrong, list(wrong.items())[:3]


def assert_matches_peft(model, sd: dict, converted: dict, prefix: str = "transformer"):
    """Every Linear's output: ours (merge, runtime) vs diffusers' converted keys loaded by PEFT."""
    names = list(linears(model))
    g = torch.Generator().manual_seed(9)
    xs = {n: torch.randn(3, linears(model)[n].in_features, generator=g) for n in names}
    ref = copy.deepcopy(model)
    ref.load_lora_adapter(converted, prefix=prefix, adapter_name="ref")
    with torch.no_grad():
        expected = {n: ref.get_submodule(n)(xs[n]) for n in names}
        changed = sum(not torch.equal(expected[n], linears(model)[n](xs[n])) for n in names)
    assert changed > 0
    for mode in ("merge", "runtime"):
        ours = copy.deepcopy(model)
        loraweave.apply(ours, sd, mode=mode, strict=True)
        with torch.no_grad():
            worst = max(rel_err(ours.get_submodule(n)(xs[n]), expected[n]) for n in names)
        assert worst <= 1e-5, (mode, worst)


def _ltx2(meta: bool, **config):
    import diffusers

    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return diffusers.LTX2VideoTransformer3DModel(**config)
    return diffusers.LTX2VideoTransformer3DModel(**config).eval()


def _ltx2_convert(sd):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

    return _convert_non_diffusers_ltx2_lora_to_diffusers(dict(sd))


def test_ltx2_original_names_full_size():
    """Audio tower, audio<->video cross-attention, adaln_single, prompt modulation and gate logits (LTX-2.3 config)."""
    model = _ltx2(True, **LTX2_FULL)
    modules = linears(model)
    sd = lora_file(modules, lambda n: f"diffusion_model.{ltx2_original(n)}", meta=True)
    assert any("audio_adaln_single" in k for k in sd) and any("to_gate_logits" in k for k in sd)
    assert any("av_ca_a2v_gate_adaln_single" in k for k in sd) and any("prompt_adaln_single" in k for k in sd)
    targets = converter_targets(_ltx2_convert, sd)
    assert set(targets.values()) == set(modules)
    assert_lands_where_the_converter_says(model, sd, targets)


def test_ltx2_original_names_match_diffusers_and_peft():
    model = _ltx2(False, **LTX2_TINY)
    sd = lora_file(linears(model), lambda n: f"diffusion_model.{ltx2_original(n)}")
    assert_matches_peft(model, sd, _ltx2_convert(sd))


def test_ltx2_swapped_rename_row_is_caught(monkeypatch):
    def swap(t):
        r = list(t.renames)
        i, j = r.index(("av_ca_a2v_gate_adaln_single", "av_cross_attn_video_a2v_gate")), r.index(
            ("av_ca_v2a_gate_adaln_single", "av_cross_attn_audio_v2a_gate"))
        r[i], r[j] = (r[i][0], r[j][1]), (r[j][0], r[i][1])
        return dataclasses.replace(t, renames=tuple(r))

    monkeypatch.setattr(arch_aliases, "ARCH_TABLES", tuple(swap(t) if t.name == "ltx2" else t for t in arch_aliases.ARCH_TABLES))
    model = _ltx2(True, **LTX2_FULL)
    sd = lora_file(linears(model), lambda n: f"diffusion_model.{ltx2_original(n)}", meta=True)
    with pytest.raises(AssertionError):
        assert_lands_where_the_converter_says(model, sd, converter_targets(_ltx2_convert, sd))


def test_ltx2_connectors_original_prefix():
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    with torch.device("meta"):
        connectors = LTX2TextConnectors()
    modules = {n: m for n, m in linears(connectors).items()}
    sd = lora_file(modules, lambda n: f"text_embedding_projection.{n.replace('text_proj_in', 'aggregate_embed')}", meta=True)
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_ltx2_lora_to_diffusers as convert,
    )

    targets = converter_targets(lambda s: convert(dict(s), "text_embedding_projection"), sd, prefix="connectors.")
    assert set(targets.values()) == set(modules)
    report = loraweave.plan({"transformer": _ltx2(True, num_layers=1), "connectors": connectors}, sd)
    assert report.unmatched == [] and {m.component for m in report.applied} == {"connectors"}
