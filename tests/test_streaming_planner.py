"""Streaming planner and hook machinery on a synthetic 50-block stack (CPU: storage and compute alike).

References are written here: a brute-force search over every resident prefix for the plan, the unstreamed
model for outputs (bit-identical), and an independent recount of device bytes from the model's own tensors at
every block call (not the streamer's ledger)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loraweave.errors import BudgetTooSmall
from loraweave.streaming import find_blocks, plan_residency, stream
from loraweave.streaming.planner import aligned

# 2 shared cores: multi-threaded tiny matmuls stall ~100x under contention (1.1 s vs 3 ms a Flux forward).
pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.down(torch.nn.functional.gelu(self.up(x)))) * self.gain


class Stack(nn.Module):
    """Embed, 50 blocks of varying width (big ones first, as in Flux: double then single blocks), head."""

    def __init__(self, n: int = 50, width: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width, 96 if i < n // 3 else 48) for i in range(n))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _bytes(module: nn.Module) -> int:
    """Slot-layout bytes of a module's own tensors, counted here from the module (each tensor 256-aligned)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum((t.numel() * t.element_size() + 255) // 256 * 256 for t in tensors)


def _brute_force(block_bytes: list[int], rest: int, budget: int, margin: int) -> int | None:
    """Longest resident prefix whose full device footprint fits, by trying every prefix length."""
    best = None
    for k in range(len(block_bytes) + 1):
        streamed = block_bytes[k:]
        footprint = rest + sum(block_bytes[:k]) + min(2, len(streamed)) * max(streamed, default=0)
        if footprint + margin <= budget:
            best = k
    return best


def test_find_blocks_splits_repeated_blocks_from_the_rest():
    model = Stack()
    found = find_blocks(model)
    assert [n for n, _ in found] == [f"blocks.{i}" for i in range(50)]
    assert all(m is model.blocks[i] for i, (_, m) in enumerate(found))


@pytest.mark.parametrize("margin", [0, 1000])
def test_plan_matches_brute_force_on_every_budget(margin):
    model = Stack()
    blocks = [_bytes(b) for b in model.blocks]
    rest = _bytes(model.embed) + _bytes(model.head)
    total = rest + sum(blocks)
    big, small = max(blocks), min(blocks)
    assert big > small  # the stack has two block sizes: the slot size depends on what is streamed
    budgets = sorted(
        {
            rest + 2 * big + margin,
            rest + 2 * big + margin - 1,
            total + margin,
            total // 2,
            total // 4,
            *range(rest + 2 * small, total + 3 * big, 997),
        }
    )
    for budget in budgets:
        want = _brute_force(blocks, rest, budget, margin)
        if want is None:
            with pytest.raises(BudgetTooSmall, match="cannot hold"):
                plan_residency([str(i) for i in range(50)], blocks, rest, budget, margin)
            continue
        plan = plan_residency([str(i) for i in range(50)], blocks, rest, budget, margin)
        assert plan.resident == [i < want for i in range(50)], budget
        assert plan.device_bytes + margin <= budget
        assert plan.slot_bytes == max(blocks[want:], default=0)


@pytest.mark.parametrize("margin", [0, 1000])
def test_spread_plan_keeps_the_most_blocks_that_fit_and_never_streams_two_in_a_row_when_half_fit(margin):
    model = Stack()
    blocks = [_bytes(b) for b in model.blocks]
    rest = _bytes(model.embed) + _bytes(model.head)
    total = rest + sum(blocks)
    n = len(blocks)
    for budget in range(rest + 2 * max(blocks) + margin, total + margin + 1, 1499):
        plan = plan_residency([str(i) for i in range(n)], blocks, rest, budget, margin, placement="spread")
        streamed = [i for i, r in enumerate(plan.resident) if not r]
        assert plan.device_bytes + margin <= budget
        assert plan.slot_bytes == max((blocks[i] for i in streamed), default=0)
        # Recount: no spread set with more resident blocks fits (evenly spaced positions, as documented).
        m = len(streamed)
        fits = [k for k in range(n + 1) if _spread_fits(blocks, rest, budget - margin, n - k)]
        assert n - m == max(fits)
        if 0 < m <= n // 2:
            assert all(b - a >= 2 for a, b in zip(streamed, streamed[1:], strict=False)), streamed
    with pytest.raises(ValueError, match="placement"):
        plan_residency(["a"], [1], 0, 10, placement="middle")


def _spread_fits(blocks: list[int], rest: int, usable: int, m: int) -> bool:
    """Whether `m` streamed blocks at evenly spaced positions fit (written here from the documented rule)."""
    n = len(blocks)
    streamed = {int((j + 0.5) * n / m) for j in range(m)} if m else set()
    slot = max((blocks[i] for i in streamed), default=0)
    return rest + sum(b for i, b in enumerate(blocks) if i not in streamed) + min(2, m) * slot <= usable


def test_plan_counts_adapter_bytes():
    blocks = [1000] * 5
    plan = plan_residency(list("abcde"), blocks, 300, 300 + 5000)
    assert plan.resident == [True] * 5 and plan.n_slots == 0
    # 500 B of adapter factors: 3 resident + 2 slots = 5800 > 5300, so only 2 resident + 2 slots (4800) fit.
    with_adapters = plan_residency(list("abcde"), blocks, 300, 300 + 5000, extra_bytes=500)
    assert with_adapters.resident == [True] * 2 + [False] * 3 and with_adapters.n_slots == 2
    assert with_adapters.device_bytes == 300 + 500 + 2000 + 2000


def _device_bytes_now(model: Stack, handle, streamed: set[int]) -> tuple[int, list[int]]:
    """Device bytes recounted from the model: rest + resident blocks + slot buffers; and which streamed blocks
    point into a slot buffer right now."""
    spans = [(s.buf.data_ptr(), s.buf.data_ptr() + s.buf.numel()) for s in handle.slots]
    in_slot = []
    for i in sorted(streamed):
        ptrs = [p.data_ptr() for p in model.blocks[i].parameters()]
        inside = [any(lo <= q < hi for lo, hi in spans) for q in ptrs]
        assert all(inside) or not any(inside), f"block {i} half in a slot"
        if all(inside):
            in_slot.append(i)
    resident = sum(_bytes(model.blocks[i]) for i in range(len(model.blocks)) if i not in streamed)
    slots = sum(aligned(s.buf.numel()) for s in handle.slots)
    return _bytes(model.embed) + _bytes(model.head) + resident + slots, in_slot


@pytest.mark.parametrize("placement", ["prefix", "spread"])
@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_stack_streams_bit_identical_and_within_budget_at_every_block(fraction, placement):
    model = Stack().eval()
    x = torch.randn(2, 7, 8, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x)
    total = _bytes(model)
    budget = int(total * fraction)
    handle = stream(model, budget=budget, device="cpu", trace=True, placement=placement)
    streamed = {i for i, r in enumerate(handle.plan.resident) if not r}
    assert (len(streamed) == 0) == (fraction == 1.0)
    if placement == "prefix":
        assert streamed == set(range(min(streamed, default=50), 50))
    checked = []

    def check(i):
        def hook(module, args):  # registered after the streamer's: runs once block i is in place
            used, in_slot = _device_bytes_now(model, handle, streamed)
            assert used <= budget
            assert in_slot == ([i] if i in streamed else [])  # only the computing block points into a slot
            checked.append(i)

        return hook

    hooks = [b.register_forward_pre_hook(check(i)) for i, b in enumerate(model.blocks)]
    try:
        with torch.no_grad():
            outs = [model(x), model(x)]
    finally:
        for h in hooks:
            h.remove()
    assert checked == list(range(50)) * 2
    assert all(torch.equal(o, ref) for o in outs)
    report = handle.report
    assert all(held <= budget for _, held in report.trace)  # the ledger, at every booking and step
    assert report.peak_bytes <= budget
    if streamed:
        stats = report.last
        want = sum(_bytes(model.blocks[i]) for i in streamed)
        assert stats.bytes_copied == want and stats.copies == len(streamed)
        assert stats.prefetched == len(streamed) and stats.on_demand == 0  # steady state: all one block ahead
        assert report.forwards == 2 and report.total.on_demand == 0  # even the first: prefetched when planned
    handle.close()
    with torch.no_grad():
        assert torch.equal(model(x), ref)


def test_budget_too_small_is_refused_with_the_needed_bytes():
    model = Stack()
    with pytest.raises(BudgetTooSmall, match="at least"):
        stream(model, budget=1000, device="cpu")
    assert not any(getattr(m, "_loraweave_streamed", False) for m in model.modules())  # nothing left behind
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_explicit_blocks_stream_only_those_and_nested_blocks_are_refused():
    model = Stack(n=6).eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(x)
    with pytest.raises(ValueError, match="inside"):
        stream(model, blocks=["blocks.1", "blocks.1.up"], budget=10**6, device="cpu")
    names = ["blocks.2", "blocks.3", "blocks.4"]
    sizes = [_bytes(model.get_submodule(n)) for n in names]
    budget = _bytes(model) - sum(sizes) + 2 * max(sizes)  # everything else resident, the three streamed
    handle = stream(model, blocks=names, budget=budget, device="cpu")
    assert handle.plan.block_names == names and handle.plan.streamed == names
    with torch.no_grad():
        assert torch.equal(model(x), ref)
        assert torch.equal(model(x), ref)
    # Steady state: three copies per forward, each one block ahead (the first forward also did the plan's
    # one).
    assert handle.report.last.copies == handle.report.last.prefetched == 3
    assert handle.report.total.copies == 7
    handle.close()


def test_a_forward_that_raises_inside_a_block_leaves_no_block_in_a_slot():
    model = Stack(n=8).eval()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x)
    sizes = [_bytes(b) for b in model.blocks]
    handle = stream(model, budget=_bytes(model) - sum(sizes) + 2 * max(sizes), device="cpu")
    hosts = {id(p): p.data_ptr() for p in model.blocks.parameters()}  # CPU storage: the original tensors
    boom = model.blocks[3].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(KeyError("boom")))
    with torch.no_grad(), pytest.raises(KeyError, match="boom"):
        model(x)
    boom.remove()
    assert {id(p): p.data_ptr() for p in model.blocks.parameters()} == hosts  # all back on host storage
    with torch.no_grad():
        assert torch.equal(model(x), ref)
    handle.close()


def test_auto_budget_on_cpu_without_a_free_memory_probe_keeps_everything_resident():
    model = Stack(n=8).eval()
    handle = stream(model, device="cpu")
    assert not handle.plan.streamed and handle.plan.device_bytes == _bytes(model)
    handle.close()


@pytest.mark.parametrize("edit", ["new_parameter", "data_assignment", "module_to"])
def test_tensors_replaced_behind_the_streamer_are_refused_not_overwritten(edit):
    model = Stack(n=6).eval()
    sizes = [_bytes(b) for b in model.blocks]
    handle = stream(model, budget=_bytes(model) - sum(sizes) + 2 * max(sizes), device="cpu")
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        model(x)
        if edit == "new_parameter":
            model.blocks[4].up.weight = nn.Parameter(model.blocks[4].up.weight * 2)
        elif edit == "data_assignment":
            model.embed.weight.data = model.embed.weight.data * 2
        else:
            model.to(torch.float64)
        with pytest.raises(RuntimeError, match="replaced behind"):
            model(x.to(model.embed.weight.dtype))
    replacement = model.blocks[4].up.weight
    value = replacement.detach().clone()
    handle.close()
    if edit == "new_parameter":  # a Parameter the user put in is never overwritten by close()
        assert model.blocks[4].up.weight is replacement and torch.equal(replacement, value)
