"""loraweave.comfy.load_lora_for_models refuses hostile or wrong input with a typed loraweave error that names
the file (or the keys, in the report), and the input MODEL and CLIP come back untouched: same patches_uuid, no
patch added, every weight bit-identical."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.comfy_files import adapter_file, dotted, kohya, target_linears
from helpers.comfy_models import BUILDERS
from safetensors.torch import save_file

from loraweave.comfy import load_lora_for_models
from loraweave.errors import AdapterFileError, ArgumentError, NoKeysLandedError, StrictApplyError, TargetError


@pytest.fixture(scope="module")
def models():
    return {name: BUILDERS[name]() for name in ("sd15", "flux")}


def snapshot(m) -> tuple:
    return (
        m.patcher.patches_uuid,
        dict(m.patcher.patches),
        m.clip.patcher.patches_uuid,
        dict(m.clip.patcher.patches),
        {k: v.clone() for k, v in m.patcher.model.state_dict().items()},
    )


def assert_unchanged(m, before: tuple) -> None:
    uuid, patches, clip_uuid, clip_patches, weights = before
    assert m.patcher.patches_uuid == uuid and m.patcher.patches == patches
    assert m.clip.patcher.patches_uuid == clip_uuid and m.clip.patcher.patches == clip_patches
    for key, value in m.patcher.model.state_dict().items():
        assert torch.equal(value, weights[key]), key


def sd15_file(m) -> dict[str, torch.Tensor]:
    return adapter_file(target_linears(m.diffusers), "lora", kohya("lora_unet_"))


def test_wrong_architecture_file_lands_nothing_and_says_so(models, tmp_path):
    path = tmp_path / "sd15_style.safetensors"
    save_file(sd15_file(models["sd15"]), str(path))
    flux = models["flux"]
    before = snapshot(flux)
    with pytest.raises(NoKeysLandedError, match="sd15_style") as caught:
        load_lora_for_models(flux.patcher, flux.clip, str(path), 1.0, 1.0)
    assert caught.value.report.keys_applied == 0 and caught.value.report.unmatched
    assert_unchanged(flux, before)


def test_missing_file(models, tmp_path):
    m = models["sd15"]
    before = snapshot(m)
    with pytest.raises(AdapterFileError, match="no_such.safetensors: no such file"):
        load_lora_for_models(m.patcher, m.clip, tmp_path / "no_such.safetensors", 1.0, 1.0)
    assert_unchanged(m, before)


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_broken_file(models, tmp_path, damage):
    m = models["sd15"]
    path = tmp_path / "broken.safetensors"
    save_file(sd15_file(m), str(path))
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"{not json" + data[17:] if damage == "header" else data[: len(data) // 2])
    before = snapshot(m)
    with pytest.raises(AdapterFileError, match="broken.safetensors"):
        load_lora_for_models(m.patcher, m.clip, str(path), 1.0, 1.0)
    assert_unchanged(m, before)


def test_strict_with_keys_that_miss(models):
    m = models["sd15"]
    sd = sd15_file(m)
    sd["lora_unet_no_such_block.lora_down.weight"] = torch.zeros(2, 32)
    sd["lora_unet_no_such_block.lora_up.weight"] = torch.zeros(32, 2)
    before = snapshot(m)
    with pytest.raises(StrictApplyError, match="2 keys") as caught:
        load_lora_for_models(m.patcher, m.clip, sd, 1.0, 1.0, strict=True)
    missed = {u.key for u in caught.value.report.unmatched}
    assert missed == {"lora_unet_no_such_block.lora_down.weight", "lora_unet_no_such_block.lora_up.weight"}
    assert_unchanged(m, before)
    # Without strict the rest lands on a clone and the report names the two misses.
    model, _, report = load_lora_for_models(m.patcher, m.clip, sd, 1.0, 1.0)
    assert report.keys_applied == len(sd) - 2 and {u.key for u in report.unmatched} == missed
    assert model.patches and not m.patcher.patches


def test_text_encoder_keys_without_clip_are_skipped(models):
    # No CLIP is a model-only request: core's LoraLoaderModelOnly skips text-encoder keys, and so does the
    # pack, counting them apart (not misses, so strict does not refuse them).
    m = models["sd15"]
    encoder = m.clip.cond_stage_model.clip_l.transformer
    sd = adapter_file(target_linears(encoder), "lora", kohya("lora_te1_"))
    with pytest.raises(NoKeysLandedError, match=f"skipped={len(sd)}"):  # nothing is left for the model
        load_lora_for_models(m.patcher, None, sd, 1.0, 1.0)
    mixed = {**sd15_file(m), **sd}
    model, clip, report = load_lora_for_models(m.patcher, None, mixed, 1.0, 1.0, strict=True)
    assert clip is None and not report.unmatched
    assert {s.key for s in report.skipped} == set(sd) and report.skipped_by_component() == {
        "text_encoder": len(sd)
    }
    assert report.keys_applied == report.keys_total == len(mixed) - len(sd)


def test_bad_arguments(models):
    m = models["sd15"]
    before = snapshot(m)
    with pytest.raises(ArgumentError, match="mode"):
        load_lora_for_models(m.patcher, m.clip, sd15_file(m), 1.0, 1.0, mode="fuse")
    with pytest.raises(ArgumentError):
        load_lora_for_models(m.patcher, m.clip, sd15_file(m), float("nan"), 1.0)
    with pytest.raises(ArgumentError, match="lora must be"):
        load_lora_for_models(m.patcher, m.clip, 42, 1.0, 1.0)
    with pytest.raises(TargetError, match="ModelPatcher"):
        load_lora_for_models(m.patcher.model, m.clip, sd15_file(m), 1.0, 1.0)
    assert_unchanged(m, before)


def test_non_finite_factors_are_typed_misses(models):
    m = models["sd15"]
    sd = sd15_file(m)
    first = next(k for k in sd if k.endswith("lora_up.weight"))
    sd[first] = sd[first].clone()
    sd[first][0, 0] = float("nan")
    model, _, report = load_lora_for_models(m.patcher, None, sd, 1.0, 0.0)
    assert "non_finite" in {u.kind for u in report.unmatched}
    for key in model.patches:
        weight = model.patch_weight_to_device(key, device_to=torch.device("cpu"), return_weight=True)
        assert torch.isfinite(weight).all(), key


def test_no_fitting_reference_resolves_comfy_names_only(models, monkeypatch, caplog):
    """Where loraweave has no reference tree at the model's widths (here: Flux with the width translation
    taken away, so the full-size catalog tree does not fit), original-named keys still land on ComfyUI's own
    modules and diffusers-named ones are typed misses; the log says why."""
    from helpers.registry import patch_records

    from loraweave.arch.registry import by_name

    m = models["flux"]
    flux_comfy = by_name()["flux"].comfy
    patch_records(monkeypatch, {"flux"}, comfy=dataclasses.replace(flux_comfy, config=None))
    ours = adapter_file(
        target_linears(m.patcher.model.diffusion_model), "lora", dotted("diffusion_model."), peft=True
    )
    diffusers_named = adapter_file(target_linears(m.diffusers), "lora", kohya("lora_transformer_"))
    with caplog.at_level("WARNING", logger="loraweave"):
        model, _, report = load_lora_for_models(m.patcher, None, {**ours, **diffusers_named}, 1.0, 0.0)
    assert "fits=no" in caplog.text
    assert report.keys_applied == len(ours) and len(report.unmatched) == len(diffusers_named)
    assert {u.kind for u in report.unmatched} == {"no_such_module"} and model.patches
