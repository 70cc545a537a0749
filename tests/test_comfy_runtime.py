"""Runtime mode and step windows inside ComfyUI (loraweave.comfy.runtime / steps) on the tiny Flux.

References: ComfyUI's own LoraLoader merge (`comfy.sd.load_lora_for_models`) of the same kohya file, which
core lands correctly; a step window is checked against sampling by hand, step range by step range, with
KSamplerAdvanced (start/end step) on the base model and the core-merged one. Tolerance 1e-5 absolute on
LATENTs of magnitude ~1 (fp32 hook path vs fp32 merged weights: measured differences are ~1e-7)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers.comfy_env import import_comfy
from helpers.comfy_hooks import te_lora
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    CallCounter,
    core_lora,
    flux_fixture,
    kohya_flux_lora,
    nothing_loaded_fixture,
    sample,
    sigmas_of,
    unload_all,
)

from loraweave.comfy.api import read_lora
from loraweave.comfy.runtime import KEY, RuntimeState, apply_runtime
from loraweave.comfy.steps import apply_step_window, percent_of
from loraweave.errors import ArgumentError, NoKeysLandedError, StrictApplyError

pytestmark = pytest.mark.usefixtures("one_thread", "nothing_loaded")
ATOL = 1e-5
STEPS = 8


@pytest.fixture(scope="module")
def loras(flux):
    return kohya_flux_lora(flux, seed=11), kohya_flux_lora(flux, seed=12, rank=6)


def runtime(model, lora, strength):
    out, _, report = apply_runtime(model, None, read_lora(lora), strength, 0.0)
    return out, report


def close(a, b):
    return torch.allclose(a["samples"], b["samples"], rtol=0, atol=ATOL)


def snapshot(patcher):
    """What must come back exactly: weights (bits), hooks and forwards on every module, the patcher's own
    state."""
    modules = dict(patcher.model.named_modules())
    return {
        "weights": {k: v.clone() for k, v in patcher.model.state_dict().items()},
        "hooks": {n: (len(m._forward_hooks), "forward" in m.__dict__) for n, m in modules.items()},
        "patcher": (
            dict(patcher.injections),
            dict(patcher.attachments),
            dict(patcher.additional_models),
            {k: list(v) for k, v in patcher.patches.items()},
            patcher.patches_uuid,
        ),
    }


def same_snapshot(a, b) -> bool:
    weights = a["weights"].keys() == b["weights"].keys() and all(
        torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"]
    )
    return weights and a["hooks"] == b["hooks"] and a["patcher"] == b["patcher"]


def test_runtime_output_equals_core_merge(flux, loras):
    model, report = runtime(flux, loras[0], 0.7)
    assert report.keys_applied == report.keys_total == 3 * 8 and not report.unmatched
    assert list(report.counts().values()) == [{"runtime": 8}]
    out = sample(model, STEPS)
    assert not close(out, sample(flux, STEPS)), "the adapter changed nothing"
    assert close(out, sample(core_lora(flux, loras[0], 0.7), STEPS))


def test_strength_change_repatches_no_weight(flux, loras):
    sample(runtime(flux, loras[0], 1.0)[0], STEPS)  # loaded, paths injected
    uuid_before = flux.model.current_weight_patches_uuid
    with CallCounter() as counter:
        changed, _ = runtime(flux, loras[0], 0.4)
        out = sample(changed, STEPS)
    assert counter.calls == 0, f"{counter.calls} calculate_weight calls after a strength change"
    assert changed.patches_uuid == flux.patches_uuid == uuid_before == flux.model.current_weight_patches_uuid
    assert close(out, sample(core_lora(flux, loras[0], 0.4), STEPS))


def test_second_loader_stacks_under_one_key(flux, loras):
    first, _ = runtime(flux, loras[0], 0.8)
    first_out = sample(first, STEPS)  # loaded and injected while the second loader runs
    with CallCounter() as counter:
        both, report = runtime(first, loras[1], -0.6)
        out = sample(both, STEPS)
    assert counter.calls == 0
    assert list(both.injections) == [KEY] and list(both.additional_models) == [KEY]
    state = both.get_attachment(KEY)
    assert isinstance(state, RuntimeState) and len(state.entries) == 2
    # one rank-concatenated pair per layer holding both adapters (4 + 6), not two nested paths
    assert len(state.paths) == 8 and all(rp.down.shape[0] == 10 for rp in state.paths)
    assert report.keys_applied == 3 * 8  # the report is the second loader's own
    reference = core_lora(core_lora(flux, loras[0], 0.8), loras[1], -0.6)
    assert close(out, sample(reference, STEPS))
    assert len(first.get_attachment(KEY).entries) == 1, "the first loader's output was modified"
    assert close(sample(first, STEPS), first_out)


def test_a_loader_leaves_a_loaded_input_injected(flux, loras):
    first, _ = runtime(flux, loras[0], 0.8)
    sample(first, STEPS)
    state = first.get_attachment(KEY)
    assert state.injected and first.is_injected
    runtime(first, loras[1], 0.5)
    assert state.injected and first.is_injected, "making a clone ejected the loaded input's paths"


def test_input_and_modules_untouched_when_not_loaded(flux, loras):
    before = snapshot(flux)
    model, _ = runtime(flux, loras[0], 1.0)
    assert same_snapshot(before, snapshot(flux)), "apply_runtime touched the input before any load"
    with_lora = sample(model, STEPS)
    base = sample(flux, STEPS)  # loading the input ejects the clone's paths
    assert close(base, sample(flux, STEPS)) and not close(base, with_lora)
    sample(model, STEPS)
    unload_all(flux)
    assert same_snapshot(before, snapshot(flux))


def test_factors_counted_and_loaded_by_model_management(flux, loras):
    import comfy.model_management as mm

    model, _ = runtime(flux, loras[0], 1.0)
    state = model.get_attachment(KEY)
    (holder,) = model.get_additional_models_with_key(KEY)
    ranks = 4 * sum(rp.out + rp.module.in_features + 1 for rp in state.paths)
    assert holder.model_size() == state.factor_bytes() == 4 * ranks  # fp32 factors and scales of every path
    sample(model, STEPS)
    loaded = [lm.model.model for lm in mm.current_loaded_models if lm.model is not None]
    assert state.holder in loaded, "the factor holder was not loaded with the model"


LOKR_TARGETS = ("double_blocks.0.img_attn.proj", "double_blocks.0.img_mlp.0", "double_blocks.0.txt_mlp.2")


def lokr_flux_lora(patcher, seed: int) -> dict:
    """A LyCORIS LoKr state dict (full w1 2x2, full w2: no alpha scaling) on LOKR_TARGETS of the tiny Flux."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for target in LOKR_TARGETS:
        rows, cols = patcher.model.diffusion_model.get_submodule(target).weight.shape
        stem = "lora_unet_" + target.replace(".", "_")
        out[f"{stem}.lokr_w1"] = torch.randn(2, 2, generator=g)
        out[f"{stem}.lokr_w2"] = torch.randn(rows // 2, cols // 2, generator=g) * 0.1
    return out


def test_structured_terms_counted_and_moved_by_model_management(flux):
    lokr = lokr_flux_lora(flux, seed=5)
    model, report = runtime(flux, lokr, 0.8)
    assert report.keys_applied == report.keys_total == len(lokr)
    state = model.get_attachment(KEY)
    assert all(rp.down is None for rp in state.paths), "LoKr took the low-rank pair route"
    (holder,) = model.get_additional_models_with_key(KEY)
    assert holder.model_size() == sum(t.nbytes for t in lokr.values())  # w1 and w2 of every layer, fp32
    assert close(sample(model, STEPS), sample(core_lora(flux, lokr, 0.8), STEPS))
    holder.model.to(
        torch.float64
    )  # what model management runs on a move (Module.to); a CPU box has one device
    read = [t for rp in state.paths for t in rp.held_tensors() if t.numel()]  # no pair: an empty scale vector
    assert len(read) == len(lokr) and all(t.dtype == torch.float64 for t in read), (
        "paths read unmoved tensors"
    )
    assert close(sample(model, STEPS), sample(core_lora(flux, lokr, 0.8), STEPS)), (
        "a stale cast after the move"
    )


def test_wrong_model_lora_refused_input_unchanged(flux):
    before = snapshot(flux)
    alien = {
        "lora_unet_input_blocks_1_1_proj_in.lora_down.weight": torch.ones(2, 8),
        "lora_unet_input_blocks_1_1_proj_in.lora_up.weight": torch.ones(8, 2),
    }
    with pytest.raises(NoKeysLandedError):
        runtime(flux, alien, 1.0)
    assert same_snapshot(before, snapshot(flux))


def window_steps(model, start: float, end: float) -> list[bool]:
    """Which sampling steps a window covers, by ComfyUI's rule: percent_to_sigma(end) < sigma <=
    percent_to_sigma(start)."""
    sampling = model.get_model_object("model_sampling")
    hi, lo = sampling.percent_to_sigma(start), sampling.percent_to_sigma(end)
    return [lo < s <= hi for s in sigmas_of(model, STEPS)]


def by_hand(flux, lora, strengths: list[float]):
    """Sample step by step with KSamplerAdvanced: the base model where strength is 0, the core merge
    elsewhere."""
    latent = None
    for i, s in enumerate(strengths):
        model = flux if s == 0 else core_lora(flux, lora, s)
        latent = sample(model, STEPS, start=i, end=i + 1, latent=latent, add_noise=i == 0)
    return latent


def test_step_window_equals_sampling_by_hand(flux, loras):
    on = window_steps(flux, 0.3, 0.7)
    assert 0 < sum(on) < STEPS - 2, f"the window should cover some steps only: {on}"
    model, report = apply_step_window(flux, loras[0], 0.9, 0.3, 0.7)
    assert list(report.counts().values()) == [{"runtime": 8}]
    with CallCounter() as counter:
        out = sample(model, STEPS)
    assert counter.calls == 0 and model.patches_uuid == flux.patches_uuid
    assert close(out, by_hand(flux, loras[0], [0.9 if x else 0.0 for x in on]))
    assert not close(out, sample(core_lora(flux, loras[0], 0.9), STEPS))


def test_step_window_ramp_equals_sampling_by_hand(flux, loras):
    start, end, ramp, strength = 0.1, 0.9, 0.3, 1.2
    model, _ = apply_step_window(flux, loras[1], strength, start, end, ramp)
    growth = math.exp(flux.get_model_object("model_sampling").shift)
    strengths = []
    for sigma, inside in zip(sigmas_of(flux, STEPS), window_steps(flux, start, end), strict=True):
        # ModelSamplingFlux: sigma = e^shift / (e^shift + 1/t − 1) with t = 1 − percent; inverted in closed
        # form
        percent = 1 - 1 / (1 + growth * (1 / sigma - 1))
        factor = min(1.0, (percent - start) / ramp, (end - percent) / ramp) if inside else 0.0
        strengths.append(strength * max(0.0, factor))
    assert len({round(s, 6) for s in strengths}) >= 4, f"the ramp should give several strengths: {strengths}"
    assert close(sample(model, STEPS), by_hand(flux, loras[1], strengths))


def test_percent_of_inverts_percent_to_sigma(flux):
    sampling = flux.get_model_object("model_sampling")
    for percent in (0.05, 0.3, 0.5, 0.77, 0.99):
        assert percent_of(sampling.percent_to_sigma(percent), sampling) == pytest.approx(percent, abs=1e-9)


def test_step_window_stacks_with_a_runtime_loader(flux, loras):
    first, _ = runtime(flux, loras[0], 0.5)
    both, _ = apply_step_window(first, loras[1], 1.0, 0.0, 0.5)
    state = both.get_attachment(KEY)
    assert [e.gate is not None for e in state.entries] == [False, True]
    on = window_steps(flux, 0.0, 0.5)
    latent = None
    merged = core_lora(flux, loras[0], 0.5)
    for i, inside in enumerate(on):
        model = core_lora(merged, loras[1], 1.0) if inside else merged
        latent = sample(model, STEPS, start=i, end=i + 1, latent=latent, add_noise=i == 0)
    assert close(sample(both, STEPS), latent)


@pytest.mark.parametrize(
    ("start", "end", "ramp"),
    [(0.5, 0.5, 0.0), (0.7, 0.2, 0.0), (-0.1, 0.5, 0.0), (0.2, 0.6, 0.3), (0.0, 1.0, -1.0)],
)
def test_step_window_bad_arguments(flux, loras, start, end, ramp):
    with pytest.raises(ArgumentError):
        apply_step_window(flux, loras[0], 1.0, start, end, ramp)


def encode(clip):
    cond, pooled = clip.encode_from_tokens(clip.tokenize("a tiny test prompt"), return_pooled=True)
    return torch.cat([cond.flatten(), pooled.flatten()])


def test_clip_side_runtime_equals_core_and_without_clip_the_keys_are_skipped(flux, loras):
    from helpers.comfy_models import tiny_clip

    clip = tiny_clip("flux")
    lora = {**loras[0], **te_lora(clip, seed=41)}
    before = snapshot(clip.patcher)
    model, new_clip, report = apply_runtime(flux, clip, read_lora(lora), 0.8, 0.6)
    assert report.keys_applied == report.keys_total == 3 * 8 + 2 * 3 * 4 and not report.unmatched
    assert same_snapshot(before, snapshot(clip.patcher)), "the input CLIP was modified"
    ours = encode(new_clip)
    core_model, core_clip = import_comfy().sd.load_lora_for_models(flux, clip, lora, 0.8, 0.6)
    assert not torch.allclose(ours, encode(clip), atol=1e-3)
    assert torch.allclose(ours, encode(core_clip), rtol=0, atol=ATOL)
    assert close(sample(model, STEPS), sample(core_model, STEPS))
    unload_all(flux, clip.patcher)
    alone, none, report = apply_runtime(flux, None, read_lora(lora), 0.8, 0.6, strict=True)
    assert none is None and report.keys_applied == report.keys_total == 3 * 8 and not report.unmatched
    assert report.skipped_by_component() == {"text_encoder": 2 * 3 * 4}  # model-only: skipped, not missed


def test_strict_refuses_a_partial_file_and_the_input_is_unchanged(flux, loras):
    partial = {
        **loras[0],
        "lora_unet_double_blocks_7_img_attn_qkv.lora_down.weight": torch.ones(2, 128),
        "lora_unet_double_blocks_7_img_attn_qkv.lora_up.weight": torch.ones(384, 2),
    }
    before = snapshot(flux)
    with pytest.raises(StrictApplyError):
        apply_runtime(flux, None, read_lora(partial), 1.0, 0.0, strict=True)
    assert same_snapshot(before, snapshot(flux))
    _, _, report = apply_runtime(flux, None, read_lora(partial), 1.0, 0.0)
    assert report.keys_applied == 3 * 8 and report.keys_total == 3 * 8 + 2
    assert [u.kind for u in report.unmatched] == ["no_such_module"] * 2


def saved(tmp_path, lora: dict, name: str = "lora.safetensors"):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file(lora, str(path))
    return path


def test_requeued_strength_change_reuses_the_built_paths(flux, loras, tmp_path):
    path, other = saved(tmp_path, loras[0]), saved(tmp_path, loras[1], "other.safetensors")
    first, _ = runtime(flux, path, 1.0)
    first_out = sample(first, STEPS)
    with CallCounter() as counter:
        changed, _ = runtime(flux, path, 0.4)
        out = sample(changed, STEPS)
    assert counter.calls == 0 and changed is not first and changed.patches_uuid == flux.patches_uuid
    old, new = first.get_attachment(KEY), changed.get_attachment(KEY)
    pairs = list(zip(old.paths, new.paths, strict=True))
    # each state's holder reads through parameters of its own, over the very same memory: nothing rebuilt or
    # copied
    assert len(pairs) == 8 and all(a is not b and same(a.down, b.down) and same(a.up, b.up) for a, b in pairs)
    assert close(out, sample(core_lora(flux, loras[0], 0.4), STEPS))
    assert close(sample(first, STEPS), first_out), "the strength change rewrote the earlier clone's strength"
    runtime(flux, other, 0.5)  # a swap, then back: the first file's paths are still kept
    back = runtime(flux, path, -0.3)[0].get_attachment(KEY)
    assert all(same(a.down, b.down) for a, b in zip(old.paths, back.paths, strict=True))
    assert close(sample(flux, STEPS), sample(flux, STEPS))  # the input ejects every clone's paths


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are one memory (a view over the same storage, same offset and shape)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )


def test_a_file_rewritten_under_the_same_name_is_read_again(flux, loras, tmp_path):
    path = saved(tmp_path, loras[0])
    stamp = path.stat()
    runtime(flux, path, 0.7)
    rewritten = kohya_flux_lora(flux, seed=13)  # the same shapes: the same size
    saved(tmp_path, rewritten)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # name, size and mtime all as before
    assert path.stat().st_size == stamp.st_size and path.stat().st_mtime_ns == stamp.st_mtime_ns
    model, _ = runtime(flux, path, 0.7)
    assert close(sample(model, STEPS), sample(core_lora(flux, rewritten, 0.7), STEPS))


class Calls:
    """Counts calls of the named module-level functions while installed (monkeypatch undoes it)."""

    def __init__(self, monkeypatch, targets) -> None:
        self.counts: dict[str, int] = {}
        for module, name in targets:
            original = getattr(module, name)
            self.counts[name] = 0

            def counted(*args, _name=name, _original=original, **kwargs):
                self.counts[_name] += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)

    def reset(self) -> None:
        self.counts = dict.fromkeys(self.counts, 0)


def test_requeues_reparse_replan_rebuild_nothing_and_leave_no_dead_model(flux, loras, tmp_path, monkeypatch):
    """A strength change re-queued from the same input and file parses, plans and builds nothing (the kept
    paths are copied, the factor holder and its ModelPatcher shared); a swap back to a kept file neither. No
    loaded model is ever left whose patcher is gone while its module lives: ComfyUI takes that for a leak and
    runs a full gc.collect() before every later load (the cost that made runtime re-queues 0.35x core's, not
    ~0.02x)."""
    import types

    import comfy.model_management as mm

    from loraweave.comfy import api, targets
    from loraweave.comfy import runtime as rt

    calls = Calls(
        monkeypatch,
        [(api, "load_adapter"), (targets, "plan_for_patcher"), (rt, "build_paths"), (rt, "FactorHolder")],
    )
    collects = []
    monkeypatch.setattr(mm, "gc", types.SimpleNamespace(collect=lambda *a: collects.append(a)))
    path, other = saved(tmp_path, loras[0]), saved(tmp_path, loras[1], "other.safetensors")
    first, _ = runtime(flux, path, 1.0)
    sample(first, STEPS)
    assert calls.counts == dict.fromkeys(calls.counts, 1)
    (factors,) = first.get_additional_models_with_key(KEY)
    del first  # the clone goes, as ComfyUI's cache drops a node's old output
    calls.reset()
    for strength in (0.4, -0.2):
        changed, _ = runtime(flux, path, strength)
        out = sample(changed, STEPS)
        assert calls.counts == dict.fromkeys(calls.counts, 0), f"a strength change re-did {calls.counts}"
        assert changed.get_additional_models_with_key(KEY) == [factors], "a new factor model per strength"
        del changed
    assert close(out, sample(core_lora(flux, loras[0], -0.2), STEPS))
    sample(runtime(flux, other, 0.5)[0], STEPS)  # a new file: parsed, planned, built once
    assert calls.counts == dict.fromkeys(calls.counts, 1)
    calls.reset()
    sample(runtime(flux, path, 0.9)[0], STEPS)  # back to the kept one
    assert calls.counts == dict.fromkeys(calls.counts, 0), f"a swap back re-did {calls.counts}"
    assert not any(lm.is_dead() for lm in mm.current_loaded_models)
    assert collects == [], "model management found a dead patcher over a live module and ran gc.collect()"
