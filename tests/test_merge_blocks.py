"""The fused merge's blocks shared by the caller and torch's spare threads (mechanisms/merge/blocks.py, issue
39): each block is merged whole, with a record of its own, by whichever thread claims it, and the records are
joined in order. The record must be the one a single thread keeps, byte for byte (its gaps re-counted across
blocks, fillers included), and any failure must put every written block back, whichever thread wrote it.

Every test sets torch's thread count itself: CI runs with OMP_NUM_THREADS=1, where no block is shared."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers.common import fail_on_call, gen
from helpers.undo_models import assert_same_bits, lora_sd, overflowing_model, state_bits
from torch import nn

import loraweave
import loraweave.mechanisms.merge.layer as layer_mod
from loraweave.errors import NonFiniteResultError
from loraweave.mechanisms.merge import blocks as blocks_mod
from loraweave.mechanisms.merge import inplace as inplace_mod
from loraweave.mechanisms.merge import native

RECORD_FIELDS = ("positions", "values", "witness", "guard_pos", "guard_w", "guard_merged")


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 600)  # native blocks of 2400 elements: many per layer


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def special_weights(dtype: torch.dtype, specials: bool = True, rows: int = 90, cols: int = 64) -> nn.Module:
    """Seeded weights with signed zeros, subnormals, the dtype's largest, infinities and NaN among them."""
    model = nn.ModuleDict({"a": nn.Linear(cols, rows, bias=False), "b": nn.Linear(rows, cols, bias=False)})
    model = model.to(dtype)
    info = torch.finfo(dtype)
    special = torch.tensor(
        [-0.0, 0.0, info.tiny / 4, -info.tiny / 2, info.max, -info.max, float("inf"), float("nan")],
        dtype=dtype,
    )
    with torch.no_grad():
        for i, layer in enumerate(model.values()):
            layer.weight.normal_(0, 0.05, generator=gen(10 + i))
            flat = layer.weight.view(-1)
            at = torch.randperm(flat.numel(), generator=gen(20 + i))[:64]
            if specials:
                flat[at] = special.repeat(8)
    return model


def merged(model: nn.Module, sd, n: int, threads, **kw) -> tuple[dict, list, object]:
    threads(n)
    handle = loraweave.apply(model, sd, mode="merge", **kw)
    records = [m.record for mod in model.modules() for m in getattr(mod, layer_mod.STACK_ATTR, [])]
    return state_bits(model), records, handle


def assert_same_records(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert type(x) is type(y) and x.encoding == y.encoding and x.nbytes == y.nbytes, (x, y)
        for name in RECORD_FIELDS:
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and torch.equal(u, v), name


def threads_calling(monkeypatch, module, name: str) -> set[str]:
    """The names of the threads that call module.name from now on (the caller's calls slowed by 5 ms: a
    helper of the pool then claims a block on any host)."""
    names: set[str] = set()
    real = getattr(module, name)

    def spied(*args):
        names.add(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.005)
        return real(*args)

    monkeypatch.setattr(module, name, spied)
    return names


def spy_calls(fn, names: set[str]):
    """fn, recording the threads that call it (the caller's calls slowed by 5 ms, as threads_calling)."""
    assert fn is not None, "no fused add was made"

    def spied(*args):
        names.add(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.005)
        return fn(*args)

    return spied


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", ["compact", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_shared_blocks_keep_the_record_one_thread_keeps(monkeypatch, small_blocks, threads, dtype, kind, n):
    if native.kernel_for(dtype) is None:
        pytest.fail(f"no native kernel for {dtype}: the shared path is the kernel's")
    sd = lora_sd(special_weights(dtype, specials=False), rel=0.3)
    one_bits, one_records, one = merged(special_weights(dtype), sd, 1, threads, undo=kind)
    names = threads_calling(monkeypatch, blocks_mod, "merge_block")
    model = special_weights(dtype)
    bits_n, records_n, handle = merged(model, sd, n, threads, undo=kind)
    assert any(name.startswith("loraweave-delta") for name in names), names  # helpers merged blocks
    assert all(torch.equal(bits_n[k], one_bits[k]) for k in one_bits)
    assert_same_records(one_records, records_n)
    handle.set_strength(
        handle.report.adapters[0]["name"], -0.6
    )  # rebuilt from the joined record, merged again
    handle.remove()
    assert_same_bits(model, state_bits(special_weights(dtype)))


@pytest.mark.parametrize("n", [2, 5])
def test_far_apart_misses_rejoin_across_blocks_with_their_fillers(small_blocks, threads, n):
    """ΔW on three rows only: steps of 300k+ positions span many blocks without a miss, so the joined first
    step of a block needs 1-byte and 2-byte fillers the block's own record did not have."""
    up = torch.zeros(1024, 2)
    up[[0, 700, 1023]] = torch.randn(3, 2, generator=gen(5))
    sd = {"a.lora_B.weight": up, "a.lora_A.weight": torch.randn(2, 512, generator=gen(6)) * 0.05}

    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({"a": nn.Linear(512, 1024, bias=False)})

    one_bits, one_records, _ = merged(model(), sd, 1, threads, undo="compact")
    m = model()
    bits_n, records_n, handle = merged(m, sd, n, threads, undo="compact")
    assert all(torch.equal(bits_n[k], one_bits[k]) for k in one_bits)
    assert_same_records(one_records, records_n)
    positions = records_n[0].decoded_positions(m.a.weight.numel(), torch.device("cpu"))
    assert bool((positions.diff() > 65535).any())
    handle.remove()
    assert_same_bits(m, state_bits(model()))


@pytest.mark.parametrize("after", [False, True], ids=["before-call", "after-call"])
@pytest.mark.parametrize("nth", [1, 3, 5])  # of 6 blocks: 3 per layer
def test_interrupt_in_any_thread_puts_every_written_block_back(
    monkeypatch, small_blocks, threads, nth, after
):
    """Ctrl-C around the n-th kernel call, on whichever thread makes it (after-call: the block is written and
    its record sits in that thread's buffers): every block written, joined or not, comes back."""
    dtype = torch.bfloat16
    model = special_weights(dtype)
    before = state_bits(model)
    kernel = native.kernel_for(dtype)
    faulty = native.Kernel(dtype, fail_on_call(nth, KeyboardInterrupt, kernel.fn, after=after))
    monkeypatch.setattr(inplace_mod, "kernel_for", lambda dt: faulty if dt == dtype else None)
    threads(3)
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(
            model, lora_sd(special_weights(dtype, specials=False), rel=0.3), mode="merge", undo="compact"
        )
    assert_same_bits(model, before)
    time.sleep(0.05)
    assert_same_bits(model, before)  # no helper wrote a block after apply returned


def test_a_helper_block_interrupted_after_its_call_is_not_written_over_by_its_next_block(
    monkeypatch, small_blocks, threads
):
    """A helper's block is written, then Ctrl-C lands on that helper; it goes on to merge another block while
    the caller is held in its first one. The interrupted block's record (in that helper's arena) must not
    be overwritten by the next block's: both are put back, bit for bit."""
    dtype = torch.bfloat16
    model = special_weights(dtype, rows=300)  # 8 blocks a layer
    before = state_bits(model)
    real = native.kernel_for(dtype).fn
    helper_calls = []

    def scripted(*args):
        if threading.current_thread() is threading.main_thread():
            deadline = time.monotonic() + 5
            while len(helper_calls) < 2 and time.monotonic() < deadline:
                time.sleep(0.001)  # the helper merges its interrupted block and the next one first
            return real(*args)
        helper_calls.append(args[3])
        out = real(*args)
        if len(helper_calls) == 1:
            raise KeyboardInterrupt("injected after a helper's kernel call")
        return out

    monkeypatch.setattr(inplace_mod, "kernel_for", lambda dt: native.Kernel(dtype, scripted))
    threads(2)
    sd = lora_sd(special_weights(dtype, specials=False, rows=300), rel=0.3)
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, sd, mode="merge", undo="compact")
    assert len(helper_calls) >= 2, helper_calls  # the helper did merge a block after its interrupted one
    assert_same_bits(model, before)


@pytest.mark.parametrize("kind", ["compact", "auto"])
def test_overflow_in_a_late_block_puts_back_the_blocks_of_every_thread(small_blocks, threads, kind):
    model, sd = overflowing_model(torch.float16, rows=400, cols=64)
    before = state_bits(model)
    threads(4)
    with pytest.raises(NonFiniteResultError, match="non-finite values in rows"):
        loraweave.apply(model, sd, undo=kind)
    assert_same_bits(model, before)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_direct_write_of_undo_none_is_shared_and_writes_the_bits_of_one(
    monkeypatch, small_blocks, threads, dtype, n
):
    """undo="none" with a bounded ΔW is written at commit by merge_direct (no record): on the caller and the
    spare threads, the bits of one thread."""
    from loraweave.mechanisms.merge import direct as direct_mod

    sd = lora_sd(special_weights(dtype, specials=False), rel=0.3)
    one, _, _ = merged(special_weights(dtype, specials=False), sd, 1, threads, undo="none")
    if dtype == torch.float32:  # ΔW added by one addmm_ a block (delta.fused_adder): spied where it is made
        real, names = layer_mod.fused_adder, set()
        monkeypatch.setattr(layer_mod, "fused_adder", lambda *a: spy_calls(real(*a), names))
    else:
        names = threads_calling(monkeypatch, direct_mod, "combine_into")
    bits_n, records, _ = merged(special_weights(dtype, specials=False), sd, n, threads, undo="none")
    assert any(name.startswith("loraweave-delta") for name in names), names
    assert all(torch.equal(bits_n[k], one[k]) for k in one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rebuild_of_a_compact_record_is_shared_and_exact(monkeypatch, small_blocks, threads, dtype):
    """remove() of a one-thread compact merge at 3 threads: the record's rebuild (ΔW, W' - ΔW and the block's
    misses) runs on the caller and the spare threads, and gives W back bit for bit."""
    from loraweave.mechanisms.merge import undo as undo_mod

    model = special_weights(dtype)
    before = state_bits(model)
    sd = lora_sd(special_weights(dtype, specials=False), rel=0.3)
    _, records, handle = merged(model, sd, 1, threads, undo="compact")
    names = threads_calling(monkeypatch, undo_mod, "combine_into")
    threads(3)
    handle.remove()
    assert any(name.startswith("loraweave-delta") for name in names), names
    assert_same_bits(model, before)


@pytest.mark.parametrize("nth", [2, 3])
def test_interrupt_while_a_block_is_joined_puts_it_back(monkeypatch, small_blocks, threads, nth):
    """Ctrl-C right after a block's first step was re-counted for joining, before the record holds it: the
    block is put back from its own record, which the re-count must not have changed."""
    dtype = torch.bfloat16
    model = special_weights(dtype)
    before = state_bits(model)
    monkeypatch.setattr(
        inplace_mod, "restep", fail_on_call(nth, KeyboardInterrupt, inplace_mod.restep, after=True)
    )
    sd = lora_sd(special_weights(dtype, specials=False), rel=0.01)  # sparse misses: steps re-counted
    threads(3)
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, sd, mode="merge", undo="compact")
    assert_same_bits(model, before)
