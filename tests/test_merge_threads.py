"""Thread use of the merge passes (mechanisms/merge/threads.py) and the early copy of a compact pass whose
elements mostly miss (inplace.copy_is_smaller); issue 39.

A merge, strength change and remove at torch's 2 threads must write the same bits and keep the same record
as at 1 thread (the passes' ops run on one intra-op thread, ΔW of the next block on a helper thread), and put
the thread count back. A layer whose delta makes most elements miss must end its compact pass early and keep
a copy, with the weight as the buffered (undo="copy") path writes it and an exact undo."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.undo_models import assert_same_bits, kinds_of, lora_sd, net, state_bits

import loraweave
import loraweave.mechanisms.merge.layer as layer_mod
from loraweave.mechanisms.merge import inplace as inplace_mod

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows: every layer is written in many blocks, so ΔW is computed ahead."""
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 600)


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; the count before is put back after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def merged_at(n: int, dtype: torch.dtype, sd: dict, strength: float, threads) -> tuple[dict, object, object]:
    """The state after a default merge at `n` torch threads, the model and its handle."""
    threads(n)
    model = net(dtype)
    handle = loraweave.apply(model, (sd, strength), mode="merge", strict=True)
    assert torch.get_num_threads() == n  # the pass's own count was put back
    return state_bits(model), model, handle


@pytest.mark.parametrize("n", [2, 5], ids=["2threads", "5threads"])  # 5: four blocks ahead, a ring of buffers
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_two_threads_write_the_bits_of_one(small_blocks, threads, dtype, n):
    sd = lora_sd(net(dtype), rel=0.3)
    one, _, h1 = merged_at(1, dtype, sd, 2.0, threads)
    two, model, h2 = merged_at(n, dtype, sd, 2.0, threads)
    assert_same_bits(model, one)
    assert kinds_of(h1) == kinds_of(h2) == {"compact"}
    assert [m.undo_bytes for m in h1.report.applied] == [m.undo_bytes for m in h2.report.applied]
    h2.set_strength(h2.report.adapters[0]["name"], -0.7)  # rebuilt and merged again at 2 threads
    h1.set_strength(h1.report.adapters[0]["name"], -0.7)
    # (h1's model is another instance) the strength change at 2 threads equals a fresh merge at 1 thread
    fresh, _, _ = merged_at(1, dtype, sd, -0.7, threads)
    assert_same_bits(model, fresh)
    threads(1)  # a record made at 2 threads is undone at 1
    h2.remove()
    assert_same_bits(model, state_bits(net(dtype)))


def test_delta_ahead_runs_on_one_intra_op_thread(monkeypatch, small_blocks, threads):
    """At 2 threads, ΔW of the next block is computed on the helper thread with torch at one thread, and
    the caller's ops run at one thread too; at 1 thread no helper thread is started."""
    seen: list[tuple[str, int]] = []
    real = layer_mod.delta_fn

    def spied(terms):
        fn = real(terms)

        def delta(*args):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            if threading.current_thread().name.startswith("loraweave-delta"):
                time.sleep(0.01)  # busy while the next block is submitted: the pool starts another thread
            return fn(*args)

        return delta

    monkeypatch.setattr(layer_mod, "delta_fn", spied)
    sd = lora_sd(net(torch.float32), rel=0.3)
    _, _, handle = merged_at(2, torch.float32, sd, 1.0, threads)
    handle.remove()
    helpers = {name for name, _ in seen if name.startswith("loraweave-delta")}
    assert helpers and {n for _, n in seen} == {1}, seen  # (pool threads: one per pass, any of them)
    seen.clear()  # at 4 threads, more than one helper computes ΔW ahead, each at one intra-op thread
    _, _, handle = merged_at(4, torch.float32, sd, 1.0, threads)
    handle.remove()
    helpers = {name for name, _ in seen if name.startswith("loraweave-delta")}
    assert len(helpers) > 1 and {n for _, n in seen} == {1}, seen  # up to min(3, blocks - 1) threads
    seen.clear()
    merged_at(1, torch.float32, sd, 1.0, threads)
    assert seen and all(name == threading.current_thread().name for name, _ in seen)


def huge_sd(dtype: torch.dtype) -> dict:
    """A legal LoRA whose up factor holds 65504 (fp16's largest) in one column: every row's ΔW dwarfs W, so
    round(W' - ΔW) misses W almost everywhere (a fuzzed file of issue 39)."""
    sd = lora_sd(net(dtype), rel=0.02)
    for key in [k for k in sd if k.endswith("lora_B.weight")]:
        sd[key] = sd[key].clone()
        sd[key][:, 0] = 65504.0
    return sd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)  # fp16 overflows
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_mostly_missing_layer_keeps_a_copy_before_any_block(monkeypatch, small_blocks, dtype, native):
    if not native:
        monkeypatch.setattr(inplace_mod, "kernel_for", lambda dtype: None)
    checks: list[tuple[int, bool]] = []
    real = inplace_mod.copy_is_smaller

    def spied(rows, misses, written):
        checks.append((written, real(rows, misses, written)))
        return checks[-1][1]

    monkeypatch.setattr(inplace_mod, "copy_is_smaller", spied)
    # native blocks of 1600 elements: 5 and 4 a layer (a layer of SAMPLED_FROM blocks or more is sampled)
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 400)
    passes: list[str] = []
    for name in ("_blocks_native", "_blocks_torch", "_blocks_shared"):
        real_pass = getattr(inplace_mod, name)
        monkeypatch.setattr(inplace_mod, name, lambda *a, _f=real_pass, _n=name: passes.append(_n) or _f(*a))
    sd = huge_sd(dtype)
    model, ref = net(dtype), net(dtype)
    handle = loraweave.apply(model, (sd, 1.0), mode="merge", strict=True)
    loraweave.apply(ref, (sd, 1.0), mode="merge", undo="copy")
    assert_same_bits(model, state_bits(ref))  # the weight the buffered path writes
    assert kinds_of(handle) == {"copy"}
    # each layer decided once, from its sampled rows, before a block was written (sampled_misses)
    assert [ok for _, ok in checks] == [True, True] and not passes, (checks, passes)
    handle.remove()
    assert_same_bits(model, state_bits(net(dtype)))


@pytest.mark.parametrize("threads_n", [1, 2])
def test_a_few_block_layer_is_not_sampled_and_still_keeps_a_copy(monkeypatch, threads, threads_n):
    """Layers of fewer than SAMPLED_FROM blocks skip the sample (it cost them more than their first block's
    check): a mostly missing one still ends its pass after that block and keeps a copy, with the weight the
    buffered path writes and an exact undo. Fails if the sample ran, or if the block check let it stay
    compact."""
    dtype = torch.bfloat16
    model, ref = net(dtype), net(dtype)
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 900)  # native blocks of 3600 elements: 3 and 2 a layer
    block = 900 * layer_mod.NATIVE_BLOCKS
    blocks = [-(-m.weight.shape[0] // (block // m.weight.shape[1])) for m in model.values()]
    assert blocks == [3, 2], blocks
    assert max(blocks) < inplace_mod.SAMPLED_FROM
    samples = []
    real = inplace_mod.sampled_misses
    monkeypatch.setattr(inplace_mod, "sampled_misses", lambda *a: samples.append(1) or real(*a))
    stops = counted_stops(monkeypatch)
    threads(threads_n)
    sd = huge_sd(dtype)
    handle = loraweave.apply(model, (sd, 1.0), mode="merge", strict=True)
    loraweave.apply(ref, (sd, 1.0), mode="merge", undo="copy")
    assert not samples and True in stops, (samples, stops)
    assert kinds_of(handle) == {"copy"}
    assert_same_bits(model, state_bits(ref))
    handle.remove()
    assert_same_bits(model, state_bits(net(dtype)))


def counted_stops(monkeypatch) -> list[bool]:
    """The results of inplace.copy_is_smaller from now on."""
    out: list[bool] = []
    real = inplace_mod.copy_is_smaller

    def spied(rows, misses, written):
        out.append(real(rows, misses, written))
        return out[-1]

    monkeypatch.setattr(inplace_mod, "copy_is_smaller", spied)
    return out


def records_of(model) -> list:
    """The undo records of the merges on `model`'s layers, in module order."""
    return [m.record for mod in model.modules() for m in getattr(mod, layer_mod.STACK_ATTR, [])]


def test_strength_change_to_mostly_missing_keeps_a_copy(monkeypatch, small_blocks):
    """A compact merge changed to a strength where most elements miss: a copy is kept, the weight equals a
    fresh copy merge at that strength, and undo is exact; back at the low strength it is compact again."""
    dtype = torch.bfloat16
    sd = huge_sd(dtype)
    model, ref = net(dtype), net(dtype)
    handle = loraweave.apply(model, (sd, 1e-6), mode="merge", strict=True)
    assert kinds_of(handle) == {"compact"}
    name = handle.report.adapters[0]["name"]
    handle.set_strength(name, 1.0)
    loraweave.apply(ref, (sd, 1.0), mode="merge", undo="copy")
    assert_same_bits(model, state_bits(ref))
    assert kinds_of(handle) == {"copy"}
    stops = counted_stops(monkeypatch)
    copies = records_of(model)
    handle.set_strength(name, 2.0)  # over a copy: a sample finds most elements miss again
    assert kinds_of(handle) == {"copy"} and stops == [True, True], stops
    assert all(a is b for a, b in zip(records_of(model), copies, strict=True))  # that copy kept, no new one
    ref2 = net(dtype)
    loraweave.apply(ref2, (sd, 2.0), mode="merge", undo="copy")
    assert_same_bits(model, state_bits(ref2))
    handle.set_strength(name, 1e-6)
    assert kinds_of(handle) == {"compact"}
    handle.remove()
    assert_same_bits(model, state_bits(net(dtype)))


def test_forced_compact_keeps_its_record_of_misses(small_blocks):
    """undo="compact" asks for the record whatever its size: no early copy."""
    sd = huge_sd(torch.bfloat16)
    model = net(torch.bfloat16)
    handle = loraweave.apply(model, (sd, 1.0), mode="merge", undo="compact", strict=True)
    assert kinds_of(handle) == {"compact"}
    handle.remove()
    assert_same_bits(model, state_bits(net(torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_small_factor_check_reads_the_exponent_bits(dtype, bad):
    """The numpy check of small factors (families/base.py) refuses what aminmax refused, keeps the largest
    finite values and subnormals."""
    from loraweave.families.base import PartRejected, check_factor

    info = torch.finfo(dtype)
    ok = torch.tensor([info.max, -info.max, info.tiny / 4, -0.0, 1.0], dtype=dtype).repeat(10)
    check_factor("lora_up.weight", ok)
    broken = ok.clone()
    broken[17] = bad
    with pytest.raises(PartRejected, match="NaN or Inf"):
        check_factor("lora_up.weight", broken)
    check_factor("lora_up.weight", broken[:17])


def spans_of(n: int, rows: int = 2) -> list[tuple[int, int]]:
    return [(i * rows, (i + 1) * rows) for i in range(n)]


def ramp_delta(calls: list[tuple[str, int, float, float]], stall: float):
    """A ΔW of rows [r0, r1) that holds r0..r1-1 in its rows; each helper thread stalls `stall` seconds on its
    first span (descheduled on a busy host). Calls are logged as (thread, r0, start, end)."""
    stalled: set[str] = set()

    def delta(base, r0, r1, out):
        name, start = threading.current_thread().name, time.perf_counter()
        if name.startswith("loraweave-delta") and name not in stalled:
            stalled.add(name)
            time.sleep(stall)
        out = out.view(r1 - r0, base.shape[1])
        out.copy_(torch.arange(r0, r1, dtype=torch.float32)[:, None].expand(-1, base.shape[1]))
        calls.append((name, r0, start, time.perf_counter()))
        return out

    return delta


@pytest.mark.parametrize("spare", [1, 3])
def test_a_stalled_helper_does_not_stall_the_caller(threads, spare):
    """While a helper stalls on the span it claimed, the caller computes the next spans the ring has room for
    itself instead of waiting; each span is computed once and every ΔW is its own rows'."""
    from loraweave.mechanisms.merge.threads import block_deltas, recorded_threads

    calls: list[tuple[str, int, float, float]] = []
    seen = []
    threads(spare + 1)
    with recorded_threads(1):  # `spare` threads lent to block_deltas
        buffers = (torch.empty(6), torch.empty(6))
        with block_deltas(ramp_delta(calls, 0.3), torch.zeros(40, 3), spans_of(20), buffers) as deltas:
            for r0, r1, d in deltas:
                assert torch.equal(d[:, 0], torch.arange(r0, r1, dtype=torch.float32)), (r0, d)
                seen.append(r0)
    assert seen == [r0 for r0, _ in spans_of(20)]
    assert sorted(r0 for _, r0, _, _ in calls) == seen  # each span computed once
    stall_end = min(end for name, _, _, end in calls if name.startswith("loraweave-delta"))
    caller = threading.current_thread().name
    during = [r0 for name, r0, start, _ in calls if name == caller and start < stall_end]
    assert during, calls  # with one future per span (before), the caller only waited


def test_a_helper_error_is_raised_at_its_span_and_nothing_is_left_running(threads):
    """A ΔW that fails on a helper is raised where the caller asks for that span, after the spans before it;
    on leaving the block (the error included) no helper computes a span of it any more."""
    from loraweave.mechanisms.merge.threads import block_deltas, recorded_threads

    calls = []

    def delta(base, r0, r1, out):
        calls.append(r0)
        time.sleep(0.002)  # slow spans: helpers are inside one when the error is raised
        if r0 == 8:
            raise ValueError("span 4")
        return out

    seen = []
    threads(4)
    with recorded_threads(1), pytest.raises(ValueError, match="span 4"):
        with block_deltas(
            delta, torch.zeros(40, 3), spans_of(20), (torch.empty(6), torch.empty(6))
        ) as deltas:
            for r0, _, _ in deltas:
                seen.append(r0)
    assert seen == [0, 2, 4, 6]
    count = len(calls)
    time.sleep(0.05)
    assert len(calls) == count, calls  # nothing of the pass ran after it returned
