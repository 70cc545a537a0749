"""Adapters on offloaded and dispatched models: accelerate cpu/disk offload and dispatch_model (cpu + disk),
pipeline sequential and model CPU offload, diffusers group offloading (block/leaf level, disk, streams).

For each form and mode: the output equals a plain (not offloaded) model with the adapters merged; a merge that
would write into a copy is refused by name (the model stays as it was); remove() leaves no hook and no cast
copy. The execution device is "cpu" here; the same cases run on "cuda" when a GPU is present (streams need
one)."""

from __future__ import annotations

import copy

import accelerate
import pytest
import torch
from diffusers import DiffusionPipeline
from diffusers.hooks import apply_group_offloading
from helpers.switch_models import LAYERS, _lora
from helpers.tiny_models import flux_forward, tiny_flux

import loraweave
from loraweave.errors import StrictApplyError
from loraweave.mechanisms.runtime.path import RuntimePath

TOL = 1e-5
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


class TinyPipe(DiffusionPipeline):
    model_cpu_offload_seq = "transformer"

    def __init__(self, transformer) -> None:
        super().__init__()
        self.register_modules(transformer=transformer)


def _dispatch(model, device, tmp):
    device_map = {
        n: "disk" if n == "single_transformer_blocks" else device for n, _ in model.named_children()
    }
    accelerate.dispatch_model(
        model, device_map=device_map, main_device=device, offload_dir=str(tmp / "dispatch")
    )
    return model


def _group(model, device, tmp, **kw):
    apply_group_offloading(model, onload_device=torch.device(device), **kw)
    return model


def _pipe(model, device, how):
    pipe = TinyPipe(model)
    getattr(pipe, how)(device=device)
    return pipe


# form -> (offload(model, device, tmp) -> apply target, what merge does: "merge" | "refuse" | "partial")
FORMS = {
    "cpu_offload": (lambda m, d, t: accelerate.cpu_offload(m, execution_device=d), "refuse"),
    "disk_offload": (
        lambda m, d, t: accelerate.disk_offload(m, offload_dir=str(t / "disk"), execution_device=d),
        "refuse",
    ),
    "dispatch_cpu_disk": (_dispatch, "partial"),
    "pipe_sequential": (lambda m, d, t: _pipe(m, d, "enable_sequential_cpu_offload"), "refuse"),
    "pipe_model": (lambda m, d, t: _pipe(m, d, "enable_model_cpu_offload"), "merge"),
    "group_block": (
        lambda m, d, t: _group(m, d, t, offload_type="block_level", num_blocks_per_group=1),
        "merge",
    ),
    "group_leaf": (lambda m, d, t: _group(m, d, t, offload_type="leaf_level"), "merge"),
    "group_block_disk": (
        lambda m, d, t: _group(
            m,
            d,
            t,
            offload_type="block_level",
            num_blocks_per_group=1,
            offload_to_disk_path=str(t / "groups"),
        ),
        "refuse",
    ),
}


@pytest.fixture(scope="module")
def setup():
    base = tiny_flux()
    sd = _lora(base, LAYERS, 1)
    merged = copy.deepcopy(base)
    loraweave.apply(merged, sd, mode="merge", strict=True)
    with torch.no_grad():
        return base, sd, flux_forward(merged), flux_forward(base)


def _runner(device):
    def run(model):
        with torch.no_grad():
            return flux_forward(model, device=device).cpu()

    return run


def _hooks(model):
    return {n: (len(m._forward_hooks), m.__dict__.get("forward")) for n, m in model.named_modules()}


def _check_removed(model, before, paths: list[RuntimePath]):
    assert _hooks(model) == before  # accelerate/diffusers hooks kept, ours gone (no hook, no fused forward)
    for rp in paths:
        assert rp._factor_cast is None or rp._factor_cast._cast == ()
        assert rp._scale_cast._cast == ()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["runtime", "auto", "merge"])
@pytest.mark.parametrize("form", FORMS)
def test_offload_forms(setup, tmp_path, form, mode, device):
    base, sd, want, plain = setup
    offload, merge_does = FORMS[form]
    model = copy.deepcopy(base)
    target = offload(model, device, tmp_path)
    run = _runner(device)
    if form == "pipe_sequential" and device == "cpu":
        # The pipeline names its device "cpu:0"; accelerate's post_forward then fails on this model with no
        # adapter at all. Its per-component cpu_offload is the "cpu_offload" form; this one runs on a GPU
        # machine.
        with pytest.raises(TypeError):
            run(model)
        return
    plain_offloaded = run(model)
    assert torch.allclose(plain_offloaded, plain, rtol=0, atol=1e-5 * plain.abs().max())
    before = _hooks(model)
    if mode == "merge" and merge_does == "refuse":
        with pytest.raises(StrictApplyError, match="did not land") as info:
            loraweave.apply(target, sd, mode="merge", strict=True)
        reasons = {u["reason"].split(";")[0] for u in info.value.report.unmatched}
        assert reasons <= {
            "cannot merge: weight is offloaded (meta device)",
            "cannot merge: diffusers group offloading reloads the weight from disk on every onload "
            "(a merge would be lost)",
        }, reasons
        assert _hooks(model) == before and torch.equal(run(model), plain_offloaded)  # nothing half-applied
        return
    handle = loraweave.apply(target, sd, mode=mode, strict=merge_does != "partial" or mode != "merge")
    mechanisms = {a.mechanism for a in handle.report.applied}
    if mode == "merge" and merge_does == "partial":  # the disk-offloaded blocks refuse, the cpu blocks merge
        assert mechanisms == {"merge"} and handle.report.unmatched
        assert all("offloaded" in u["reason"] for u in handle.report.unmatched)
    else:
        out = run(model)
        assert (out - want).abs().max() <= TOL * want.abs().max()
        if mode == "auto":
            assert mechanisms == (
                {"merge"}
                if merge_does == "merge"
                else {"merge", "runtime"}
                if merge_does == "partial"
                else {"runtime"}
            )
        for rp in (
            handle.runtime_paths
        ):  # one cast copy, on the layer's execution device (on CPU: the factors themselves)
            assert rp._factor_cast._key[0].type == device and rp._factor_cast._key[1] == torch.float32
            assert device != "cpu" or (
                rp._factor_cast._cast[0] is rp.down and rp._factor_cast._cast[1] is rp.up
            )
    paths = list(handle.runtime_paths)
    handle.remove()
    _check_removed(model, before, paths)
    assert torch.equal(run(model), plain_offloaded)


def test_merge_refused_under_stream_groups_names_the_reason(setup, monkeypatch):
    """Streams need CUDA to be set up; here a non-stream group is marked as streamed to check the refusal and
    that auto then takes the runtime path (the real stream form runs in test_offload_forms on a GPU
    machine)."""
    base, sd, want, _ = setup
    model = copy.deepcopy(base)
    apply_group_offloading(
        model, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1
    )
    block = model.transformer_blocks[0]
    monkeypatch.setattr(block._diffusers_hook.hooks["group_offloading"].group, "stream", object())
    with pytest.raises(StrictApplyError) as info:
        loraweave.apply(model, sd, mode="merge", strict=True)
    assert {u["key"].split(".lora")[0] for u in info.value.report.unmatched} == {"transformer." + LAYERS[0]}
    assert all("streams onloads from pinned copies" in u["reason"] for u in info.value.report.unmatched)
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    by_module = {a.module: a.mechanism for a in handle.report.applied}
    assert by_module["transformer_blocks.0.attn.to_q"] == "runtime"
    assert by_module["single_transformer_blocks.0.proj_out"] == "merge"
    monkeypatch.undo()
    assert (_runner("cpu")(model) - want).abs().max() <= TOL * want.abs().max()
    handle.remove()


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="diffusers group offloading with streams needs CUDA"
)
@pytest.mark.parametrize("mode", ["runtime", "auto"])
def test_group_offload_with_streams_cuda(setup, mode):
    base, sd, want, plain = setup
    model = copy.deepcopy(base)
    apply_group_offloading(
        model,
        onload_device=torch.device("cuda"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=True,
    )
    before = _hooks(model)
    handle = loraweave.apply(model, sd, mode=mode, strict=True)
    assert {a.mechanism for a in handle.report.applied} == {"runtime"}
    out = _runner("cuda")(model)
    assert (out - want).abs().max() <= 1e-4 * want.abs().max()  # TF32/cuBLAS vs CPU reference
    paths = list(handle.runtime_paths)
    handle.remove()
    _check_removed(model, before, paths)
