"""The streamer's copy/compute ordering, checked on CPU with copies that really run beside compute.

On CUDA a slot is filled on a side stream and compute waits for the slot's `ready` event; a copy into a slot
waits for compute to be done with it. Here `ThreadCopier` gives the handle the same interface with a worker
thread in place of the side stream, and makes every ordering mistake visible: a fill poisons the slot (NaN) at
once and writes the real values only after a delay, on the worker. Compute that reads a slot before waiting
for it, or a fill issued into the slot a block is computing from, therefore changes the output. The reference
is the same model unstreamed; outputs must be bit-identical. Two negative controls (a handle that skips the
wait, one that fills the busy slot) show the harness catches both mistakes."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
from helpers.streaming_models import flux_batch2, flux_deep, lora_sd, min_budget, pack_like_cuda

import loraweave
from loraweave.streaming import handle as handle_module
from loraweave.streaming import stream
from loraweave.streaming.clock import ClockCopier
from loraweave.streaming.slots import Copier

pytestmark = pytest.mark.usefixtures("one_thread")  # torch on one thread for the module (conftest)
DELAY_S = 0.004  # worker delay before each copy: far longer than the main thread needs to reach a wrong read


class ThreadCopier(Copier):
    """Copier whose copies run on one worker thread in issue order (a stream), after a poison and a delay."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.asynchronous = True
        self.jobs: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.copy_s = 0.0
        self.fills = 0
        threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            pairs, ready = self.jobs.get()
            time.sleep(DELAY_S)
            t0 = time.perf_counter()
            for view, src in pairs:
                view.copy_(src)
            with self.lock:
                self.copy_s += time.perf_counter() - t0
            ready.set()
            self.jobs.task_done()

    def attach(self, slot) -> None:
        slot.ready = threading.Event()
        slot.ready.set()  # nothing pending

    def fill(self, slot, unit, stats) -> None:
        assert not slot.busy, "a copy was issued into the slot a block is computing from"
        slot.views = unit.slot_views(slot.buf)
        pairs = unit.copy_pairs(slot.buf)
        slot.ready = threading.Event()  # a new copy: compute must wait for this one
        slot.buf.fill_(0xFF)  # NaN in every float dtype until the worker writes the real values
        self.jobs.put((pairs, slot.ready))
        self.fills += 1
        stats.bytes_copied += unit.slot_layout_bytes
        stats.copies += 1

    def wait(self, slot, stats, waited_copy_s: float = 0.0) -> None:
        t0 = time.perf_counter()
        slot.ready.wait()
        stats.stall_seconds += time.perf_counter() - t0

    def done(self, slot) -> None:
        pass  # compute on CPU is finished when the block's forward returns

    def resolve(self, stats, block: bool = False) -> None:
        if block:
            self.jobs.join()
        with self.lock:
            stats.copy_seconds += self.copy_s
            self.copy_s = 0.0

    def drain(self) -> None:
        self.jobs.join()


@pytest.fixture
def threaded(monkeypatch):
    made: list[ThreadCopier] = []

    def factory(device):
        made.append(ThreadCopier(device))
        return made[-1]

    monkeypatch.setattr(handle_module, "Copier", factory)
    return made


def streamed_pair(seed: int):
    plain, model = flux_deep(seed), flux_deep(seed)
    sd = lora_sd(plain, seed=seed + 10)
    return plain, model, sd


@pytest.mark.parametrize(
    ("packed", "placement"),
    [(False, "prefix"), (True, "prefix"), (True, "spread")],
    ids=["per-tensor", "packed-runs", "packed-spread"],
)
def test_async_copies_stay_exact_with_runtime_lora_strength_changes_and_a_switch(
    threaded, packed, placement, monkeypatch
):
    if packed:
        pack_like_cuda(monkeypatch)
    plain, model, sd = streamed_pair(seed=1)
    other = lora_sd(plain, seed=99)
    ref = loraweave.apply(plain, sd, mode="runtime")
    s = stream(
        model, budget=min_budget(model, lora=True, resident=1), device="cpu", trace=True, placement=placement
    )
    h = loraweave.apply(model, sd, mode="runtime")
    name, ref_name = next(iter(h.strengths)), next(iter(ref.strengths))
    assert len(s.plan.streamed) >= 4  # enough streamed blocks that prefetch and wrap-around both happen
    for strength in (1.0, 1.0, 0.3, -0.7):
        h.set_strength(name, strength)
        ref.set_strength(ref_name, strength)
        assert torch.equal(flux_batch2(model), flux_batch2(plain))
    ref.remove()
    h.remove()
    loraweave.apply(plain, other, mode="runtime")
    loraweave.apply(model, other, mode="runtime")
    for _ in range(2):
        assert torch.equal(flux_batch2(model), flux_batch2(plain))
    report = s.sync_report()
    copier = threaded[-1]
    assert copier.fills > 0 and report.total.prefetched > 0
    assert report.overlap is not None and 0.0 <= report.overlap <= 1.0
    assert max(held for _, held in report.trace) <= s.plan.budget
    s.close()


def test_harness_catches_compute_that_does_not_wait_for_its_copy(threaded, monkeypatch):
    plain, model, _ = streamed_pair(seed=2)
    monkeypatch.setattr(ThreadCopier, "wait", lambda self, slot, stats, waited_copy_s=0.0: None)
    s = stream(model, budget=min_budget(model), device="cpu")
    out = flux_batch2(model)
    assert not torch.equal(out, flux_batch2(plain))
    s.close()


def test_harness_catches_a_copy_into_the_busy_slot(threaded, monkeypatch):
    plain, model, _ = streamed_pair(seed=3)
    real_fill = handle_module.StreamHandle._fill

    def wrong_slot(self, slot, i, prefetch):  # a handle bug: prefetch into the slot the current block reads
        if self._active is not None:
            busy = self._active[1]
            busy.busy = False  # slip past the copier's own check: the poison must catch it
            slot = busy
        real_fill(self, slot, i, prefetch)

    s = stream(model, budget=min_budget(model), device="cpu")
    monkeypatch.setattr(handle_module.StreamHandle, "_fill", wrong_slot)
    out = flux_batch2(model)
    assert not torch.equal(out, flux_batch2(plain))
    monkeypatch.undo()
    s.close()


@pytest.mark.parametrize(("copy_s", "stalls"), [(0.9, False), (1.0, False), (1.5, True)])
def test_prefetch_runs_one_block_ahead_so_copies_no_slower_than_compute_never_stall(
    monkeypatch, copy_s, stalls
):
    """Every block computes in 1 s of virtual time. Each streamed block's copy is issued when the previous one
    starts computing (its slot freed by the one before), so copies of <= 1 s hide completely, the first
    streamed block of a forward included (prefetched at the end of the previous one); slower copies show up as
    stalls."""
    clocks: list[ClockCopier] = []
    monkeypatch.setattr(
        handle_module,
        "Copier",
        lambda device: clocks.append(ClockCopier(device, lambda unit: copy_s)) or clocks[-1],
    )
    plain, model, _ = streamed_pair(seed=4)
    s = stream(model, budget=min_budget(model), device="cpu")
    assert len(s.plan.streamed) == len(s.units)
    hooks = [
        u.module.register_forward_hook(lambda *a: clocks[-1].advance(1.0), prepend=True) for u in s.units
    ]
    for _ in range(2):  # the first forward learns the order (and starts cold)
        flux_batch2(model)
    clock = clocks[-1]
    t0, stall0 = clock.now, clock.stall
    assert torch.equal(flux_batch2(model), flux_batch2(plain))
    assert (clock.stall - stall0 > 0) == stalls
    assert clock.now - t0 == pytest.approx(len(s.units) + (clock.stall - stall0))
    for h in hooks:
        h.remove()
    s.close()
