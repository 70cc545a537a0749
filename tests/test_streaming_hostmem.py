"""Host copies of streamed blocks (packed runs, as pinned for CUDA), tensor-subclass sizes, bitsandbytes
layers.

References: a brute-force search over every way to cut a layout into runs; the real tensor layout of a
Flux-width block (meta device) for the pinned-memory overhead; the unstreamed model for outputs
(bit-identical); the inner tensors of torchao subclasses for their byte counts."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from helpers import quant_backends
from helpers.streaming_models import flux_batch2, flux_deep, lora_sd, min_budget, pack_like_cuda
from torch import nn

import loraweave
from loraweave.streaming import hostmem, outside, stream
from loraweave.streaming.planner import aligned, tensor_bytes

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread for the module (conftest)


def brute_force_waste(sizes: list[int]) -> int:
    """Least allocated-minus-used bytes over every set of cut points (pinned: power-of-two rounding)."""
    best = None
    for cuts in itertools.product([False, True], repeat=len(sizes) - 1):
        waste, run = 0, sizes[0]
        for cut, size in zip(cuts, sizes[1:], strict=True):
            if cut:
                waste += hostmem.allocated(run, True) - run
                run = size
            else:
                run += size
        waste += hostmem.allocated(run, True) - run
        best = waste if best is None else min(best, waste)
    return best


def spans_of(sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in sizes:
        out.append((at, at + s))
        at += s
    return out


def waste_of(runs: list[tuple[int, int]]) -> int:
    return sum(hostmem.allocated(b - a, True) - (b - a) for a, b in runs)


def test_group_runs_is_the_least_waste_cut_and_covers_the_layout_in_order():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(1, 10, (1,), generator=g))
        sizes = [aligned(int(torch.randint(1, 5000, (1,), generator=g))) for _ in range(n)]
        spans = spans_of(sizes)
        runs = hostmem.group_runs(spans, pin=True)
        assert runs[0][0] == 0 and runs[-1][1] == spans[-1][1]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(runs))
        assert {a for a, _ in runs} <= {a for a, _ in spans}  # cuts only between tensors
        assert waste_of(runs) == brute_force_waste(sizes)
    assert hostmem.group_runs(spans_of([300, 700, 5000]), pin=False) == [(0, 6000)]  # unpinned: not rounded


def test_runs_stay_under_the_cap_unless_one_tensor_is_larger(monkeypatch):
    monkeypatch.setattr(hostmem, "MAX_RUN", 1024)
    runs = hostmem.group_runs(spans_of([512, 512, 512, 4096, 256]), pin=True)
    assert all(b - a <= 1024 or b - a == 4096 for a, b in runs)
    assert (1536, 5632) in runs


@pytest.mark.parametrize("part", ["double", "single"])
def test_pinned_copy_of_a_flux_width_block_costs_under_1_1x_its_bytes(part):
    """Real layout (meta FluxTransformer2DModel at Flux.1 widths, bf16): per-tensor pinning would cost
    ~1.55x."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56],
            guidance_embeds=True,
        ).to(torch.bfloat16)
    block = model.transformer_blocks[0] if part == "double" else model.single_transformer_blocks[0]
    sizes = [aligned(p.numel() * p.element_size()) for p in block.parameters()]
    used = sum(sizes)
    per_tensor = sum(hostmem.allocated(s, True) for s in sizes)
    packed = sum(hostmem.allocated(b - a, True) for a, b in hostmem.group_runs(spans_of(sizes), pin=True))
    assert per_tensor / used > 1.5
    assert packed / used < 1.1, packed / used


@pytest.fixture
def packed_like_cuda(monkeypatch):
    pack_like_cuda(monkeypatch)


def test_packed_host_copies_stream_bit_identical_and_close_restores_values_and_objects(packed_like_cuda):
    plain, model = flux_deep(seed=11), flux_deep(seed=11)
    sd = lora_sd(plain, seed=12)
    ref = loraweave.apply(plain, sd, mode="runtime")
    before = {n: (id(p), p.detach().clone()) for n, p in model.named_parameters()}
    s = stream(model, budget=min_budget(model, lora=True, resident=1), device="cpu", trace=True)
    h = loraweave.apply(model, sd, mode="runtime")
    streamed = [u for u in s.units if u.name in s.plan.streamed]
    assert streamed and all(u.runs for u in streamed)
    assert all(
        len(u.copy_pairs(torch.empty(u.slot_layout_bytes, dtype=torch.uint8)))
        == len(u.runs) + len(u.factor_runs)
        for u in streamed
    )  # one transfer per run, not per tensor
    for strength in (1.0, 0.4):
        h.set_strength(next(iter(h.strengths)), strength)
        ref.set_strength(next(iter(ref.strengths)), strength)
        assert torch.equal(flux_batch2(model), flux_batch2(plain))
    h.remove()
    s.close()
    after = dict(model.named_parameters())
    for name, (ident, value) in before.items():
        assert id(after[name]) == ident and torch.equal(after[name], value), name
        assert after[name].device.type == "cpu"
    assert all(u.runs == [] and u.factor_runs == [] for u in s.units)  # host copies dropped


def test_torchao_blocks_are_sized_by_their_inner_tensors_and_stream_bit_identical():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    def build():
        torch.manual_seed(0)
        root = nn.Module()
        root.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)) for _ in range(4)
        )
        quantize_(root, Int8WeightOnlyConfig())
        root.forward = lambda x: [x := b(x) for b in root.blocks][-1]
        return root

    plain, model = build(), build()
    weight = model.blocks[0][0].weight
    names, _ = weight.__tensor_flatten__()
    inner = sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)
    assert tensor_bytes(weight) == inner < weight.numel() * weight.element_size()
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain(x)
    block = 2 * aligned(inner) + 2 * aligned(256 * 4)  # two int8 weights (inner tensors) + two fp32 biases
    s = stream(model, budget=2 * block, device="cpu", trace=True)  # two slots and nothing else: all streamed
    assert s.units[0].nbytes == block and len(s.plan.streamed) == 4
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert max(held for _, held in s.report.trace) <= 2 * block
    s.close()


def test_bitsandbytes_int8_layers_are_refused_and_the_model_is_left_untouched():
    bnb = pytest.importorskip("bitsandbytes")
    root = nn.Module()
    root.blocks = nn.ModuleList(bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False) for _ in range(3)).to(
        "cpu"
    )
    data = [(id(b.weight), b.weight.data_ptr()) for b in root.blocks]
    with pytest.raises(ValueError, match="bitsandbytes int8"):
        stream(root, budget=10**6, device="cpu")
    assert [(id(b.weight), b.weight.data_ptr()) for b in root.blocks] == data
    assert not any(b._forward_pre_hooks for b in root.blocks)


def test_bitsandbytes_4bit_quant_state_is_counted_as_resident_bytes():
    bnb = pytest.importorskip("bitsandbytes")

    def build():
        torch.manual_seed(0)
        root = nn.Module()
        root.blocks = nn.ModuleList(
            bnb.nn.Linear4bit(128, 128, quant_type="nf4", compute_dtype=torch.float32) for _ in range(3)
        ).to("cpu")
        root.forward = lambda x: [x := b(x) for b in root.blocks][-1]
        return root.eval()

    plain, model = build(), build()
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = plain(x), model(x)  # the first eval forward may repack the weight for the CPU kernel
    state = model.blocks[0].weight.quant_state
    expected = 3 * sum(
        t.numel() * t.element_size() for t in (state.absmax, state.code) if isinstance(t, torch.Tensor)
    )
    kept = outside.resident_outside_bytes(model, torch.device("cpu"))
    assert kept >= expected
    block = aligned(128 * 64) + aligned(128 * 4)  # packed nf4 weight (uint8) + fp32 bias
    s = stream(
        model, budget=kept + 2 * block, device="cpu", trace=True
    )  # fits only with the state counted once
    assert s.plan.extra_bytes == kept and len(s.plan.streamed) == 3
    with torch.no_grad():
        assert torch.equal(model(x), want)
    assert max(held for _, held in s.report.trace) <= kept + 2 * block
    s.close()


QUANT_CASES = sorted(quant_backends.CASES)


def quantized_chain(backend: str, kind: str) -> nn.Sequential:
    """Three quantized layers 256->256->256->128 from two of quant_backends' quantized pairs: with three
    blocks, streaming through two slots holds less than keeping them all."""
    a, b = quant_backends.quantized(backend, kind), quant_backends.quantized(backend, kind)
    return nn.Sequential(a[0], b[0], a[1])


@pytest.mark.parametrize("case", QUANT_CASES, ids=["-".join(c) for c in QUANT_CASES])
def test_every_quantized_backend_streams_bit_identical_with_a_runtime_lora_or_is_refused(case):
    """All three quantized layers streamed through two slots (storage and compute on CPU), a runtime LoRA on
    each: outputs equal the same model unstreamed. bitsandbytes int8 is refused (it computes from its own CB
    copy)."""
    backend, kind = case
    blocker = quant_backends.kind_blocker(backend, kind)
    if blocker:
        pytest.skip(blocker)  # reported by test_quant_backends.test_every_case_runs_here_or_is_reported
    plain, model = quantized_chain(backend, kind), quantized_chain(backend, kind)
    names = ["0", "1", "2"]
    g = torch.Generator().manual_seed(5)
    sd = {}
    for name in names:
        layer = plain.get_submodule(name)
        sd[f"{name}.lora_A.weight"] = torch.randn(4, layer.in_features, generator=g) * 0.05
        sd[f"{name}.lora_B.weight"] = torch.randn(layer.out_features, 4, generator=g) * 0.05
    if "int8" in kind and backend == "bitsandbytes":
        with pytest.raises(ValueError, match="bitsandbytes int8"):
            stream(model, budget=10**8, device="cpu", blocks=names)
        return
    loraweave.apply(plain, sd, mode="runtime")
    loraweave.apply(model, sd, mode="runtime")
    probe = stream(model, budget=10**8, device="cpu", blocks=names)
    fixed, sizes = probe.plan.rest_bytes + probe.plan.extra_bytes, [u.nbytes for u in probe.units]
    probe.close()
    budget = fixed + 2 * max(sizes)
    s = stream(model, budget=budget, device="cpu", blocks=names, trace=True)
    x = torch.randn(3, quant_backends.IN, generator=g)
    with torch.no_grad():
        want = plain(x)
        for _ in range(2):
            assert torch.equal(model(x), want)
    assert len(s.plan.streamed) == 3 and s.report.last.copies == 3
    assert max(held for _, held in s.report.trace) <= budget
    s.close()
    with torch.no_grad():
        assert torch.equal(model(x), want)
