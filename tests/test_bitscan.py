"""The undo records' bit scans: the numpy forms (CPU) and the torch forms (CUDA; forced here) agree
exactly."""

import pytest
import torch

from loraweave.mechanisms.merge import bitscan
from loraweave.mechanisms.merge.undo import bits


@pytest.fixture(params=["numpy", "torch"])
def form(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(bitscan, "_np", lambda t: None)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 7, 8, 9, 1000])
def test_differ_pack_unpack_put(form, dtype, numel):
    g = torch.Generator().manual_seed(numel)
    b = torch.randn(numel, generator=g).to(dtype)
    a = b.clone()
    flip = torch.randperm(numel, generator=g)[: numel // 3]
    bits(a)[flip] ^= 1
    if numel > 8:
        a[1], b[1] = -0.0, 0.0  # equal as numbers, different bits
        a[2] = float("nan")
    expect = (bits(a) != bits(b)).nonzero().squeeze(1)
    mask = torch.empty(numel, dtype=torch.bool)
    found = bitscan.differ(bits(a), bits(b), mask)
    assert found.dtype == torch.int64 and torch.equal(found, expect)

    packed = bitscan.pack_positions(found, numel)
    assert packed.dtype == torch.uint8 and packed.numel() == (numel + 7) // 8
    reference = (
        sum(1 << (int(p) % 8) for p in found if int(p) < 8) if numel else 0
    )  # bit i of byte 0 = element i
    assert (int(packed[0]) if numel else 0) == reference
    assert torch.equal(bitscan.unpack_positions(packed, numel), expect)

    out = bits(a).clone()
    bitscan.put(out, found, bits(b)[found])
    assert torch.equal(out, bits(b))


def test_both_forms_pack_the_same_bytes(monkeypatch):
    positions = torch.tensor([0, 3, 8, 9, 63, 64, 99])
    as_numpy = bitscan.pack_positions(positions, 100)
    monkeypatch.setattr(bitscan, "_np", lambda t: None)
    assert torch.equal(bitscan.pack_positions(positions, 100), as_numpy)
