"""The fused in-place merge (mechanisms/merge/inplace.py) and the compact record's encodings (undo.py).
Tests that inject faults into the torch path's steps select it; the native kernel has test_merge_native.

The fused path writes W' into the weight block by block; every test checks it against the buffered path (an
undo="copy" merge of the same model, bit for bit) or an fp64 formula, and that any failure midway (a block
whose values overflow, an interrupt) leaves the weight bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.common import fail_on_call, rel_err
from helpers.undo_models import assert_same_bits, kinds_of, lora_sd, overflowing_model, state_bits
from torch import nn

import loraweave
import loraweave.mechanisms.merge.layer as layer_mod
from loraweave.errors import NonFiniteResultError
from loraweave.mechanisms.merge import inplace as inplace_mod
from loraweave.mechanisms.merge import undo as undo_mod
from loraweave.mechanisms.merge.undo import GAP_ENCODINGS, CompactRecord, encode_gaps

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def model_of(dtype: torch.dtype, rows: int = 70, cols: int = 48) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(cols, rows), "b": nn.Linear(rows, cols, bias=False)}).to(dtype)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few rows, so a layer is written in many steps (W' of early blocks lands before later
    ones)."""
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 300)


@pytest.mark.parametrize("kind", ["auto", "compact", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_in_place_merge_matches_the_buffered_path(small_blocks, kind, dtype):
    model, ref = model_of(dtype), model_of(dtype)
    before = state_bits(model)
    sd = lora_sd(model, rel=0.3)
    handle = loraweave.apply(model, (sd, 2.0), mode="merge", undo=kind, strict=True)
    loraweave.apply(
        ref, (sd, 2.0), mode="merge", undo="copy"
    )  # the buffered path: W' built aside, then copied
    assert_same_bits(model, state_bits(ref))
    expect = (
        model_of(dtype).a.weight.double() + 2.0 * (sd["a.lora_B.weight"] @ sd["a.lora_A.weight"]).double()
    )
    assert rel_err(model.a.weight, expect) <= (1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-6)
    if kind == "none":
        assert kinds_of(handle) == {"none"}
        return
    assert kinds_of(handle) <= ({"compact"} if kind == "compact" else {"compact", "copy"})
    handle.set_strength(handle.report.adapters[0]["name"], -0.5)
    handle.remove()
    assert_same_bits(model, before)


def test_auto_takes_a_copy_rebuilt_from_the_merged_weight(small_blocks):
    """Misses everywhere (a delta far above W): "auto" keeps a copy, rebuilt from W' after the in-place
    write."""
    model = model_of(torch.float16)
    before = state_bits(model)
    sd = lora_sd(model, rel=50.0)
    handle = loraweave.apply(model, sd, mode="merge", undo="auto")
    assert kinds_of(handle) == {"copy"}
    handle.remove()
    assert_same_bits(model, before)


@pytest.mark.parametrize("kind", ["auto", "compact", "none"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_overflow_in_a_late_block_puts_the_written_blocks_back(small_blocks, kind, dtype):
    """Every block before the last is written when the last one overflows: all of them must come back."""
    model, sd = overflowing_model(dtype)
    before = state_bits(model)
    with pytest.raises(NonFiniteResultError, match="non-finite values in rows"):
        loraweave.apply(model, sd, mode="merge", undo=kind)
    assert_same_bits(model, before)


@pytest.mark.parametrize("kind", ["auto", "compact", "none"])
@pytest.mark.parametrize("nth", [1, 5, 12])
def test_interrupt_between_blocks_puts_the_written_blocks_back(monkeypatch, small_blocks, kind, nth):
    # the checked path of undo="none" (a bounded ΔW is written at commit: test_merge_direct), the torch blocks
    if kind == "none":
        monkeypatch.setattr(layer_mod.MergedModule, "_overflow_free", lambda *args: False)
    monkeypatch.setattr(inplace_mod, "kernel_for", lambda dtype: None)  # native faults: test_merge_native
    model = model_of(torch.bfloat16)
    before = state_bits(model)
    monkeypatch.setattr(inplace_mod, "differ", fail_on_call(nth, KeyboardInterrupt, inplace_mod.differ))
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, lora_sd(model, rel=0.3), mode="merge", undo=kind)
    assert_same_bits(model, before)


def decode(encoding: str, positions: torch.Tensor, numel: int) -> torch.Tensor:
    record = CompactRecord(encoding, positions, *(torch.zeros(0),) * 5, 1, 1, torch.device("cpu"))
    return record.decoded_positions(numel, torch.device("cpu"))


@pytest.mark.parametrize("encoding", list(GAP_ENCODINGS))
def test_gap_encodings_round_trip_at_their_limits(encoding):
    """Steps of exactly the largest an entry holds, one more, many times more, and positions past 2**31."""
    dtype, most = GAP_ENCODINGS[encoding]
    tails = [0, 1, most - 1, most, most + 1, 2 * most, 2 * most + 1, 7 * most + 3]
    positions = torch.tensor(sorted({sum(tails[: i + 1]) for i in range(len(tails))}), dtype=torch.int64)
    far = (1 << 31) + 5 if most > 255 else (1 << 24) + 5
    positions = torch.cat([positions, positions[-1] + torch.tensor([far, far + most, far + most + 1])])
    steps = torch.diff(positions, prepend=positions.new_full((1,), -1))
    encoded = encode_gaps(steps, dtype, most)
    assert encoded.dtype == dtype
    assert torch.equal(decode(encoding, encoded, int(positions[-1]) + 1), positions)
    sizes = undo_mod.compact_sizes(int(positions[-1]) + 1, steps, 2)
    width = encoded.element_size()
    fixed = undo_mod.WITNESSES * 2 + undo_mod.GUARDS * (8 + 4)
    assert (
        sizes[encoding] == encoded.numel() * width + positions.numel() * 2 + fixed
    )  # the size paid is exact


def test_bf16_record_of_a_trained_size_delta_stays_under_a_tenth():
    """‖ΔW‖ = 3 % of ‖W‖ on bf16 (issue 28's outside check): the record is at most 10 % of the touched
    bytes."""
    torch.manual_seed(0)
    model = nn.ModuleDict({f"l{i}": nn.Linear(512, 512, bias=False) for i in range(2)}).to(torch.bfloat16)
    before = state_bits(model)
    handle = loraweave.apply(model, lora_sd(model, rel=0.03, rank=32), mode="merge")
    touched = sum(m.weight.numel() * m.weight.element_size() for m in model.values())
    assert kinds_of(handle) == {"compact"}
    assert handle.report.undo_bytes() <= 0.10 * touched, handle.report.undo_bytes() / touched
    handle.remove()
    assert_same_bits(model, before)


def test_undo_none_keeps_no_encoded_record_while_it_runs(monkeypatch):
    """undo="none" skips encoding: its records stay raw int64 positions until apply drops them."""
    model = copy.deepcopy(model_of(torch.float32, rows=256, cols=256))
    monkeypatch.setattr(undo_mod, "compact_record", fail_on_call(1, AssertionError, undo_mod.compact_record))
    monkeypatch.setattr(inplace_mod, "compact_record", undo_mod.compact_record)
    handle = loraweave.apply(model, lora_sd(model), mode="merge", undo="none")
    assert kinds_of(handle) == {"none"} and handle.report.undo_bytes() == 0
