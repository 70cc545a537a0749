"""Layer streaming on tiny real diffusers models, with runtime adapters (CPU: storage and compute alike).

Reference: an identical, unstreamed model carrying the same adapters; outputs must be bit-identical. Device
bytes are checked against the budget at every ledger event, and adapter factor bytes are recounted here from
the LoRA shapes."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.streaming_models import (
    RANK,
    _aligned,
    aligned_bytes,
    flux_batch2,
    flux_blocks,
    flux_deep,
    footprint,
    kept_factor_bytes,
    lora_sd,
    min_budget,
    rest_bytes,
)
from helpers.tiny_models import tiny_flux, tiny_sdxl_unet, unet_forward

import loraweave
from loraweave.streaming import find_blocks, stream

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")


# 2 shared cores: multi-threaded tiny matmuls stall ~100x under contention (1.1 s vs 3 ms a Flux forward).
pytestmark = pytest.mark.usefixtures("one_thread")


def assert_within(handle, budget: int) -> None:
    assert handle.report.trace, "tracing must be on"
    worst = max(held for _, held in handle.report.trace)
    assert worst <= budget, f"ledger held {worst} B over budget {budget} B"


def watch_device_bytes(model, handle, budget: int, lora: bool) -> tuple[list, list]:
    """Pre-hooks (run after the streamer's) that recount device bytes from the model at every block call: the
    rest and resident blocks (with their factors), the slot buffers, the kept factors; and check that only the
    computing block points into a slot, its LoRA factors included. Returns (hook handles, block calls
    seen)."""
    blocks = flux_blocks(model)
    calls = []

    def factor_casts(block):
        return [
            t
            for m in block.modules()
            if isinstance(m, torch.nn.Linear)
            for t in m.__dict__["forward"].__self__._factor_cast._cast
        ]

    def hook(index):
        def check(module, args):
            spans = [(sl.buf.data_ptr(), sl.buf.data_ptr() + sl.buf.numel()) for sl in handle.slots]
            streamed = [i for i, r in enumerate(handle.plan.resident) if not r]
            inside = lambda t: any(lo <= t.data_ptr() < hi for lo, hi in spans)  # noqa: E731
            in_slot = [i for i in streamed if all(inside(p) for p in blocks[i].parameters())]
            assert in_slot == ([index] if index in streamed else [])
            if lora:
                for i in (
                    streamed
                ):  # the computing block's factors are slot views; no other streamed block holds any
                    casts = factor_casts(blocks[i])
                    assert (len(casts) > 0 and all(inside(t) for t in casts)) if i == index else casts == []
            resident = rest_bytes(model) + sum(
                footprint(b, lora) for i, b in enumerate(blocks) if i not in streamed
            )
            used = resident + sum(_aligned(sl.buf.numel()) for sl in handle.slots)
            used += kept_factor_bytes(model) if lora else 0
            assert used <= budget, (used, budget)
            calls.append(index)

        return check

    hooks = [b.register_forward_pre_hook(hook(i)) for i, b in enumerate(blocks)]
    return hooks, calls


def snapshot(model: torch.nn.Module) -> dict:
    return {
        n: (id(t), t.data_ptr(), t.device, t.detach().clone())
        for n, t in [*model.named_parameters(), *model.named_buffers()]
    }


def assert_restored(model: torch.nn.Module, snap: dict) -> None:
    now = snapshot(model)
    assert now.keys() == snap.keys()
    for name, (ident, ptr, device, value) in snap.items():
        assert now[name][:3] == (ident, ptr, device), name
        assert torch.equal(now[name][3], value), name
    assert not any("_loraweave_streamed" in m.__dict__ for m in model.modules())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("when", ["lora_before_stream", "lora_after_stream"])
@pytest.mark.parametrize("resident", [0, 3])  # every block streamed / a resident prefix of three
def test_flux_streamed_bit_identical_with_runtime_lora_and_strength_changes(when, resident):
    plain, model = flux_deep(seed=2), flux_deep(seed=2)
    sd = lora_sd(plain, seed=7)
    base = flux_batch2(plain)
    ref_handle = loraweave.apply(plain, sd, mode="runtime")
    budget = min_budget(model, lora=True, resident=resident)
    if when == "lora_before_stream":
        handle = loraweave.apply(model, sd, mode="runtime")
        s = stream(model, budget=budget, device="cpu", trace=True)
    else:
        s = stream(model, budget=budget, device="cpu", trace=True)
        assert torch.equal(flux_batch2(model), base)  # streamed, no adapter yet
        handle = loraweave.apply(model, sd, mode="runtime")
    assert handle.report.counts() == ref_handle.report.counts() and not handle.report.unmatched
    want = flux_batch2(plain)
    assert not torch.equal(want, base)  # the LoRA changes the output
    hooks, calls = watch_device_bytes(model, s, budget, lora=True)
    for _ in range(2):  # two calls in a row
        assert torch.equal(flux_batch2(model), want)
    assert calls == list(range(8)) * 2
    # Block factors travel with their block (counted in its bytes); the others stay on the device, counted
    # apart.
    assert s.plan.extra_bytes == kept_factor_bytes(model)
    assert s.plan.block_bytes == [footprint(b, True) for b in flux_blocks(model)]
    assert s.plan.resident == [True] * resident + [False] * (8 - resident)
    for value in (
        0.3,
        -1.25,
    ):  # strength changes between calls, with the next forward's first block prefetched
        ref_handle.set_strength(sd_name(ref_handle), value)
        handle.set_strength(sd_name(handle), value)
        want = flux_batch2(plain)
        assert torch.equal(flux_batch2(model), want)
        assert torch.equal(flux_batch2(model), want)
    assert s.report.last.prefetched == len(s.plan.streamed) and s.report.last.on_demand == 0
    assert_within(s, budget)
    for h in hooks:
        h.remove()
    handle.remove()
    assert torch.equal(flux_batch2(model), base)
    s.close()


def sd_name(handle) -> str:
    (name,) = handle.strengths
    return name


def test_adapter_switch_between_forwards_replans_and_stays_exact():
    plain, model = tiny_flux(seed=3), tiny_flux(seed=3)
    sd_a, sd_b = lora_sd(plain, seed=11), lora_sd(plain, seed=12)
    budget = min_budget(model, lora=True)
    s = stream(model, budget=budget, device="cpu", trace=True)
    h = loraweave.apply(model, sd_a, mode="runtime")
    r = loraweave.apply(plain, sd_a, mode="runtime")
    assert torch.equal(flux_batch2(model), flux_batch2(plain))
    h.remove()
    r.remove()
    h = loraweave.apply(model, sd_b, mode="runtime")
    r = loraweave.apply(plain, sd_b, mode="runtime")
    assert torch.equal(flux_batch2(model), flux_batch2(plain))
    # One re-plan when the first adapter arrived; the switch to a same-sized one keeps plan and slots, but the
    # slot prefetched at the end of the last forward held the old adapter's factors: versioned, so re-copied.
    assert s.report.last.stale == 1 and s.report.last.on_demand == 1
    assert s.report.replans == 1 and s.plan.extra_bytes == kept_factor_bytes(model)
    assert_within(s, budget)
    s.close()


def test_versioned_slot_catches_a_weight_written_after_its_prefetch():
    plain, model = tiny_flux(seed=4), tiny_flux(seed=4)
    s = stream(model, budget=min_budget(model), device="cpu", trace=True)
    assert torch.equal(flux_batch2(model), flux_batch2(plain))
    # The last block prefetched transformer_blocks.0 for the next forward; now its weight changes on the host.
    with torch.no_grad():
        for m in (plain, model):
            m.transformer_blocks[0].attn.to_q.weight.mul_(1.5)
    assert torch.equal(flux_batch2(model), flux_batch2(plain))
    assert s.report.last.stale == 1 and s.report.last.on_demand == 1
    s.close()


def test_merge_is_refused_on_a_streamed_model_and_auto_goes_runtime():
    model = tiny_flux(seed=5)
    sd = lora_sd(model, seed=9)
    s = stream(model, budget=min_budget(model, lora=True), device="cpu")
    with pytest.raises(loraweave.NoKeysLandedError) as refused:  # nothing can merge: a typed refusal
        loraweave.apply(model, sd, mode="merge")
    assert refused.value.report.keys_applied == 0
    assert all("streamed" in u["reason"] for u in refused.value.report.unmatched)
    merged = loraweave.apply(model, sd, mode="merge", allow_empty=True)
    assert merged.report.keys_applied == 0
    merged.remove()
    auto = loraweave.apply(model, sd, mode="auto")
    assert auto.report.counts() == {"transformer": {"runtime": len(sd) // 2}}
    auto.remove()
    s.close()


def test_release_then_forward_replans_against_what_is_free_and_close_restores_exactly():
    plain, model = tiny_flux(seed=6), tiny_flux(seed=6)
    snap = snapshot(model)
    base = flux_batch2(plain)
    sd = lora_sd(plain, seed=8)
    ref = loraweave.apply(plain, sd, mode="runtime")
    want = flux_batch2(plain)
    handle = loraweave.apply(model, sd, mode="runtime")
    total = rest_bytes(model) + kept_factor_bytes(model) + sum(footprint(b, True) for b in flux_blocks(model))
    low = min_budget(model, lora=True)
    free = {"bytes": total}  # a simulated device: "auto" budgets follow it
    s = stream(model, budget="auto", device="cpu", free_bytes=lambda: free["bytes"], trace=True)
    assert not s.plan.streamed and torch.equal(flux_batch2(model), want)  # everything fits: all resident
    free["bytes"] = low - s.ledger.current  # someone else took memory: re-clamped at the next forward
    mark = len(s.report.trace)
    assert torch.equal(flux_batch2(model), want)
    assert len(s.plan.streamed) == 4 and s.report.peak_bytes <= total
    assert all(held <= low for event, held in s.report.trace[mark:] if not event.startswith("-"))
    free["bytes"] = total - s.ledger.current  # memory came back: the ratchet keeps the small plan ...
    assert torch.equal(flux_batch2(model), want) and len(s.plan.streamed) == 4
    s.release()  # ... until residency is released (e.g. for a VAE decode)
    assert s.ledger.current == 0
    free["bytes"] = total
    assert torch.equal(flux_batch2(model), want) and not s.plan.streamed
    s.close()
    assert torch.equal(flux_batch2(model), want)  # the adapter still applies after close
    handle.remove()
    ref.remove()
    assert_restored(model, snap)
    assert torch.equal(flux_batch2(model), base)


def test_grad_enabled_forward_is_refused():
    model = tiny_flux(seed=1)
    s = stream(model, budget=min_budget(model), device="cpu")
    g = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="inference-only"):
        model(
            hidden_states=torch.randn(1, 16, 16, generator=g),
            encoder_hidden_states=torch.randn(1, 5, 32),
            pooled_projections=torch.randn(1, 32),
            timestep=torch.tensor([0.5]),
            guidance=torch.tensor([3.5]),
            img_ids=torch.zeros(16, 3),
            txt_ids=torch.zeros(5, 3),
            return_dict=False,
        )
    s.close()


def test_unet_blocks_stream_bit_identical_and_learn_the_call_order():
    plain, model = tiny_sdxl_unet(seed=1), tiny_sdxl_unet(seed=1)
    with torch.no_grad():
        want = unet_forward(plain)
    blocks = find_blocks(model)
    sizes = [aligned_bytes(b) for _, b in blocks]
    budget = aligned_bytes(model) - sum(sizes) + 2 * max(sizes)
    assert budget < aligned_bytes(model)
    s = stream(model, budget=budget, device="cpu", trace=True)
    names = [n for n, _ in blocks]
    assert names[:4] == ["down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1"]  # registration order
    with torch.no_grad():
        assert torch.equal(unet_forward(model), want)
        # The mid block (resnet, attention's two blocks, resnet) runs between the down and up blocks: the
        # first forward taught the call order, and the plan was re-made along it.
        mid = [
            "mid_block.resnets.0",
            "mid_block.attentions.0.transformer_blocks.0",
            "mid_block.attentions.0.transformer_blocks.1",
            "mid_block.resnets.1",
        ]
        assert sorted(names[4:]) == sorted(mid)
        assert s.plan.block_names == names[:2] + mid + names[2:4]
        assert torch.equal(unet_forward(model), want)
    assert s.report.last.on_demand == 0 and s.report.last.prefetched == len(blocks)
    assert_within(s, budget)
    s.close()


def test_sdnq_quantized_blocks_stream_bit_identical_with_runtime_lora():
    import sdnq  # a test dependency (the quantized issue): missing = a failure, never a skip
    from torch import nn

    def build() -> nn.Module:
        torch.manual_seed(0)
        root = nn.Module()
        root.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(6)
        )
        sdnq.sdnq_post_load_quant(root, add_skip_keys=False, weights_dtype="uint4", torch_dtype=torch.float32)
        assert type(root.blocks[0][0]).__name__ == "SDNQLinear"
        return root

    def run(root, x):
        with torch.no_grad():
            for b in root.blocks:
                x = b(x)
        return x

    class Stack(nn.Module):  # a forward that calls the blocks, as a backbone does
        def __init__(self, root):
            super().__init__()
            self.blocks = root.blocks

        def forward(self, x):
            return run(self, x)

    plain, model = Stack(build()), Stack(build())
    g = torch.Generator().manual_seed(2)
    sd = {}
    for i in range(6):
        for j in (0, 2):
            sd[f"blocks.{i}.{j}.lora_A.weight"] = torch.randn(RANK, 256, generator=g) * 0.1
            sd[f"blocks.{i}.{j}.lora_B.weight"] = torch.randn(256, RANK, generator=g) * 0.1
    x = torch.randn(2, 256, generator=g)
    loraweave.apply(plain, sd, mode="runtime")
    block = aligned_bytes(model.blocks[0])
    budget = 4 * block + 12 * (RANK * 256 * 2 + RANK) * 4  # two resident, two slots, the factors
    s = stream(model, budget=budget, device="cpu", trace=True)
    loraweave.apply(model, sd, mode="runtime")
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
        assert torch.equal(model(x), plain(x))
    assert len(s.plan.streamed) == 4 and s.report.last.bytes_copied == 4 * block
    assert_within(s, budget)
    s.close()


def test_auto_on_a_streamed_quantized_layer_goes_runtime_not_into_the_side_channel():
    import sdnq
    from torch import nn

    torch.manual_seed(0)
    root = nn.Module()
    root.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
    sdnq.sdnq_post_load_quant(root, add_skip_keys=False, weights_dtype="uint4", torch_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    sd = {}
    for i in range(4):
        sd[f"blocks.{i}.lora_A.weight"] = torch.randn(RANK, 256, generator=g) * 0.1
        sd[f"blocks.{i}.lora_B.weight"] = torch.randn(256, RANK, generator=g) * 0.1
    s = stream(root, budget=10**7, device="cpu")
    h = loraweave.apply(root, sd, mode="auto")
    try:
        assert {m.mechanism for m in h.report.applied} == {"runtime"}
    finally:
        h.remove()
        s.close()


def test_gpu_benchmark_script_runs_end_to_end_on_a_tiny_cpu_stack(tmp_path):
    """benchmarks/stream_gpu.py must run in one command on a CUDA machine; its --tiny CPU mode runs the same
    code (build, LoRA, budgets 100/50/25 %, strength change) so a broken script is found here, not on the
    device."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "stream_gpu.py"
    out = tmp_path / "stream.json"
    run = subprocess.run(
        [sys.executable, str(script), "--tiny", "--device", "cpu", "--steps", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["settings"]
    assert [(r["budget_fraction"], r["placement"]) for r in rows] == [
        (1.0, "prefix"),
        (0.5, "prefix"),
        (0.5, "spread"),
        (0.25, "prefix"),
        (0.25, "spread"),
    ]
    assert all(r["bit_equal"] and r["bit_equal_after_strength_change"] for r in rows)
    assert rows[0]["streamed_blocks"] == 0 and rows[3]["streamed_blocks"] > rows[1]["streamed_blocks"] > 0
