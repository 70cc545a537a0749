"""The arithmetic of sizes at the sizes where it would break: 2**24 elements (float32 holds every integer only
up to there), more than 65,535 elements between two stored positions (compact undo's uint16 gaps), 2**31 bytes
(int32 byte counts and file offsets).

Each test builds only the tensor it needs (a sparse set of differing positions in a 2**24+ element weight, a
sparse file, meta tensors), so the whole module stays under about 200 MB resident and a few seconds."""

from __future__ import annotations

import json
import os

import pytest
import torch

from loraweave.arguments import byte_size
from loraweave.io.safetensors_file import SafetensorsFile, read_safetensors_header
from loraweave.io.write import build_header
from loraweave.mechanisms.merge import bitscan
from loraweave.mechanisms.merge.inplace import merge_in_place
from loraweave.mechanisms.merge.undo import (
    GAP_ENCODINGS,
    CompactRecord,
    bits,
    merge_with_record,
    record_of_misses,
    witness_positions,
)
from loraweave.streaming.planner import aligned, plan_residency, tensor_bytes

ROWS, COLS = 4097, 4096  # 16,781,312 elements: past 2**24, and 4097 rows leave a 1-row last block of 64
CHUNK_ROWS = 64
CPU = torch.device("cpu")


def _no_delta(base: torch.Tensor, r0: int, r1: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """ΔW = 0: an undo then recomputes W' itself, so it misses W exactly where W' and W differ."""
    return out.view(r1 - r0, -1).zero_() if out is not None else base.new_zeros(r1 - r0, base.shape[1])


def _weight(dtype: torch.dtype = torch.float16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(ROWS, COLS, generator=g).to(dtype)


def _record_and_restore(w: torch.Tensor, positions: torch.Tensor) -> tuple[CompactRecord, torch.Tensor]:
    merged = w.clone()
    flat = merged.view(-1)
    flat[positions] = flat[positions] + 1.0  # W' differs from W only there
    record = record_of_misses(w, merged, positions, CHUNK_ROWS, force=True)
    record.restore(merged, _no_delta)  # block by block through the searchsorted bounds of 64-row blocks
    return record, merged


def _sparse_positions(n: int) -> torch.Tensor:
    """Misses 65,536 from the start, then 70,000 and 16.6M apart, the last of the second-to-last block, 2**24
    (the first element of the last, one-row block) and the very last element."""
    assert n - COLS == 2**24
    return torch.tensor([65_535, 65_535 + 70_000, n - COLS - 1, n - COLS, n - 1])


def _dense_positions(n: int) -> torch.Tensor:
    """Misses 200 apart (uint8 steps win) with gaps of 256, 300 and 70,000 among them, past 2**24 to the
    end."""
    steps = torch.full((n // 200,), 200)
    steps[[10, 1000, 50_000, 80_000]] = torch.tensor([256, 300, 70_000, 65_536])
    positions = torch.cumsum(steps, 0) - 1
    return torch.cat([positions[positions < n - 1], torch.tensor([n - 1])])


@pytest.mark.parametrize(("encoding", "make"), [("gaps", _sparse_positions), ("gaps8", _dense_positions)])
def test_gap_encodings_hold_long_steps_past_2_24(encoding, make):
    """uint16 gaps (sparse misses) and uint8 gaps8 (dense ones) with steps beyond the entry's largest (65,535,
    resp. 255): filler entries keep every step in range, the decoded positions are exactly the misses, and the
    restore puts W back bit for bit in every 64-row block (the last a single row)."""
    w = _weight()
    n = w.numel()
    positions = make(n)
    assert int(positions[-1]) == n - 1 > 2**24 and bool((torch.diff(positions) > 0).all())
    dtype, most = GAP_ENCODINGS[encoding]
    assert int(torch.diff(positions).max()) > most  # at least one step needs fillers
    record, restored = _record_and_restore(w, positions)
    assert record.encoding == encoding and record.positions.dtype == dtype
    assert bool((record.positions == 0).any())  # filler entries were written
    assert torch.equal(record.decoded_positions(n, CPU), positions)
    assert torch.equal(bits(restored), bits(w))


def test_bitmask_positions_past_2_24():
    """Dense misses choose the bitmask: positions decoded past 2**24 land on the right elements."""
    w = _weight(torch.bfloat16)
    positions = torch.arange(5, w.numel(), 3)
    record, restored = _record_and_restore(w, positions)
    assert record.encoding == "bitmask"
    assert torch.equal(record.decoded_positions(w.numel(), CPU), positions)
    assert torch.equal(bits(restored), bits(w))


def test_torch_scans_match_numpy_scans_past_2_24(monkeypatch):
    """The torch forms (what CUDA runs) of differ, pack, unpack and put give the numpy forms' results."""
    n = 2**24 + 11
    a = torch.zeros(n, dtype=torch.int16)
    b = a.clone()
    where = torch.tensor([0, 7, 2**24 - 1, 2**24, 2**24 + 3, n - 1])
    b[where] = 1
    mask = torch.empty(n, dtype=torch.bool)
    expected = (bitscan.differ(a, b, mask), bitscan.pack_positions(where, n))
    monkeypatch.setattr(bitscan, "_np", lambda t: None)
    got = (bitscan.differ(a, b, mask), bitscan.pack_positions(where, n))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[0], where)
    assert torch.equal(got[1], expected[1])
    assert torch.equal(bitscan.unpack_positions(got[1], n), where)
    flat = torch.zeros(n, dtype=torch.int16)
    bitscan.put(flat, where, torch.full((where.numel(),), 9, dtype=torch.int16))
    assert torch.equal(flat.nonzero().squeeze(1), where)


def _merge_copy_out(w, delta_fn):
    merged, record = merge_with_record(w, delta_fn, "compact", CHUNK_ROWS)
    return merged.clone(), record  # a scratch buffer: copied out before anything else merges


def _merge_fused(w, delta_fn):
    merged, kept = w.clone(), []
    merge_in_place(merged, delta_fn, "compact", CHUNK_ROWS, False, {"lora"}, kept.append)
    return merged, kept[0]


@pytest.mark.parametrize(
    "merge", [_merge_copy_out, _merge_fused], ids=["merge_with_record", "merge_in_place"]
)
def test_low_rank_merge_and_compact_undo_past_2_24(merge):
    """A real rank-4 merge into a 16.8M-element bf16 weight, through both merge paths: W' checked against fp64
    on strided rows (one bf16 rounding: within half an ulp plus fp32's error, bounded by one ulp), the compact
    record restores W bit for bit."""
    w = _weight(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    up, down = torch.randn(ROWS, 4, generator=g) * 0.05, torch.randn(4, COLS, generator=g) * 0.05

    def delta_fn(base, r0, r1, out=None):
        d = up[r0:r1] @ down
        return out.view(d.shape).copy_(d) if out is not None else d

    merged, record = merge(w, delta_fn)
    rows = torch.tensor(sorted({*range(0, ROWS, 97), ROWS - 1}))
    ref = w[rows].double() + up[rows].double() @ down.double()
    ulp = 2.0 ** (torch.floor(torch.log2(ref.abs().clamp_min(2.0**-126))) - 7)
    assert bool(((merged[rows].double() - ref).abs() <= ulp).all())
    assert isinstance(record, CompactRecord) and record.encoding != "raw"
    record.restore(merged, delta_fn)
    assert torch.equal(bits(merged), bits(w))


def test_witness_positions_stay_in_range_and_integral():
    """Every witness index is an integer in [0, numel) and the last one is numel - 1, up to 2**40 elements."""
    for n in (2**24 + 1, 3072 * 15360, 2**31 + 7, 2**40 + 3):
        p = witness_positions(n)
        assert int(p.min()) == 0 and int(p.max()) == n - 1
        assert bool((torch.diff(p) > 0).all())


GIB2 = 2**31


def test_byte_counts_past_2_31_on_meta_tensors():
    """Streaming's byte counts of meta tensors over 2**31 bytes are exact Python ints, and the planner places
    blocks of such sizes."""
    big = torch.empty(2**30 + 3, dtype=torch.float16, device="meta")  # 2**31 + 6 bytes
    assert tensor_bytes(big) == GIB2 + 6
    assert aligned(tensor_bytes(big)) == GIB2 + 256
    blocks = [GIB2 + 6] * 3  # all resident needs exactly 4·2**31 + 18 bytes, as do two resident plus one slot
    plan = plan_residency(["a", "b", "c"], blocks, rest_bytes=GIB2, budget=4 * GIB2 + 17)
    assert plan.resident == [False, False, False] and (plan.n_slots, plan.slot_bytes) == (2, GIB2 + 6)
    plan = plan_residency(["a", "b", "c"], blocks, rest_bytes=GIB2, budget=4 * GIB2 + 18)
    assert plan.resident == [True, True, True] and plan.n_slots == 0
    assert byte_size("3GiB", "budget") == 3 * 2**30 and byte_size("4.5GB", "budget") == 4_500_000_000


def test_safetensors_offsets_past_2_31(tmp_path):
    """A tensor stored after 2**31 bytes of another (a sparse file: no disk used) is read from the right
    bytes; the writer's header offsets for it are exact."""
    path = tmp_path / "big.safetensors"
    entries = [("big", torch.float16, (2**30 + 4,)), ("tail", torch.float32, (4,))]
    head = build_header(entries, None)
    tail = torch.tensor([1.5, -2.0, 3.25, 2.0**-20])
    with open(path, "wb") as f:
        f.write(head)
        f.seek(len(head) + 2 * (2**30 + 4))
        f.write(tail.numpy().tobytes())
    header, _, start = read_safetensors_header(path)
    assert header["tail"][2:] == (GIB2 + 8, GIB2 + 24)
    assert json.loads(head[8:])["tail"]["data_offsets"] == [GIB2 + 8, GIB2 + 24]
    f = SafetensorsFile(path)
    try:
        assert torch.equal(f.get("tail"), tail)
    finally:
        f.close()
    assert os.path.getsize(path) == start + GIB2 + 24
