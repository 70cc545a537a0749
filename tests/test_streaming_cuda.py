"""Layer streaming on a CUDA device: pinned packed host copies, side-stream prefetch, events (skipped without
CUDA).

Run on a GPU machine with `bash scripts/device_check.sh` (these tests, then benchmarks/stream_gpu.py).
Reference: the same tiny Flux fully resident on the device with the same adapters; outputs must be
bit-identical (the same kernels run on the same values; only where the weights come from differs)."""

from __future__ import annotations

import pytest
import torch
from helpers.streaming_models import flux_deep, lora_sd
from helpers.tiny_models import tiny_flux

import loraweave
from loraweave.streaming import stream

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path: needs a CUDA device")


def inputs(device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    kw = dict(
        hidden_states=torch.randn(2, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g),
        timestep=torch.tensor([0.5, 0.5]),
        guidance=torch.tensor([3.5, 3.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(5, 3),
        return_dict=False,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def least_budget(model) -> tuple[int, list[int]]:
    """(rest + kept adapter bytes, each block's slot bytes), read from a probe stream that keeps
    everything."""
    probe = stream(model, budget=10**9, device="cuda", margin=0)
    fixed, sizes = probe.plan.rest_bytes + probe.plan.extra_bytes, [u.nbytes for u in probe.units]
    probe.close()
    return fixed, sizes


@pytest.mark.parametrize("placement", ["prefix", "spread"])
def test_cpu_held_model_streams_to_cuda_bit_identical_and_close_restores_it_on_the_cpu(placement):
    plain, model = flux_deep(seed=2).cuda(), flux_deep(seed=2)
    sd = lora_sd(plain, seed=7)
    ref = loraweave.apply(plain, sd, mode="runtime")
    before = {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()}
    h = loraweave.apply(model, sd, mode="runtime")
    fixed, sizes = least_budget(model)
    budget = (
        fixed + 2 * max(sizes) + 2 * min(sizes)
    )  # prefix: both double blocks resident; spread: one single
    s = stream(model, budget=budget, device="cuda", margin=0, trace=True, placement=placement)
    assert s.plan.resident == (
        [True, True] + [False] * 6 if placement == "prefix" else [False] * 3 + [True] + [False] * 4
    )
    assert all(r.host.is_pinned() for u in s.units for r in u.runs)
    kw = inputs("cuda")
    name, ref_name = next(iter(h.strengths)), next(iter(ref.strengths))
    with torch.no_grad():
        for strength in (1.0, 1.0, 0.25):
            h.set_strength(name, strength)
            ref.set_strength(ref_name, strength)
            assert torch.equal(model(**kw)[0], plain(**kw)[0])
        s.release()
        assert torch.equal(model(**kw)[0], plain(**kw)[0])  # re-planned after the release
    report = s.sync_report()
    assert report.total.prefetched > 0 and report.copy_bandwidth and report.overlap is not None
    assert max(held for _, held in report.trace) <= budget
    h.remove()
    s.close()
    after = dict(model.named_parameters())
    for n, (ident, value) in before.items():
        assert id(after[n]) == ident and after[n].device.type == "cpu" and not after[n].is_pinned(), n
        assert torch.equal(after[n], value), n


def test_cuda_model_streams_with_auto_budget_and_stays_exact():
    plain, model = tiny_flux(seed=3).cuda(), tiny_flux(seed=3).cuda()
    sd = lora_sd(plain, seed=8)
    loraweave.apply(plain, sd, mode="runtime")
    s = stream(model, budget="auto", device="cuda")
    loraweave.apply(model, sd, mode="runtime")
    kw = inputs("cuda")
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(**kw)[0], plain(**kw)[0])
    s.close()
    assert all(p.device.type == "cuda" for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model(**kw)[0], plain(**kw)[0])


def test_every_block_streamed_through_two_slots_matches_resident():
    plain, model = tiny_flux(seed=4).cuda(), tiny_flux(seed=4)
    sd = lora_sd(plain, seed=9)
    loraweave.apply(plain, sd, mode="runtime")
    loraweave.apply(model, sd, mode="runtime")
    fixed, sizes = least_budget(model)
    s = stream(model, budget=fixed + 2 * max(sizes), device="cuda", margin=0)
    kw = inputs("cuda")
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(**kw)[0], plain(**kw)[0])
    assert len(s.plan.streamed) == len(s.units)
    s.close()
