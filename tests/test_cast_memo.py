"""A merge casts each half-precision LoRA factor once per layer (families/base.py CastMemo), not once per
block of rows, and the merged and restored weights keep their bits: the cast values are the same, so ΔW is
too."""

from __future__ import annotations

import pytest
import torch
from helpers.undo_models import assert_same_bits, lora_sd, state_bits
from torch import nn

import loraweave
import loraweave.families.lora as lora_family
import loraweave.mechanisms.merge.layer as layer_mod
from loraweave.families.base import CastMemo, cast_once


def test_cast_once_keeps_one_cast_per_memo():
    t = torch.randn(6, 5).half().t()  # not contiguous: the cast is made contiguous
    assert cast_once(t, torch.float32) is not cast_once(t, torch.float32)  # no memo: a fresh cast each time
    memo = CastMemo()
    with memo:
        first = cast_once(t, torch.float32)
        assert cast_once(t, torch.float32) is first
        assert first.is_contiguous() and torch.equal(first, t.float())
        assert cast_once(first, torch.float32) is first  # same dtype: the tensor itself
    with memo:  # entered again (the next block of the same layer): the same cast
        assert cast_once(t, torch.float32) is first
    assert cast_once(t, torch.float32) is not first  # closed


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_merge_casts_each_factor_once_per_layer(monkeypatch, dtype):
    """8 blocks of rows per layer: the down factor is cast to fp32 once per merge and once per undo (8 times
    each before), and the merge and its undo give the bits they gave before (checked against undo="copy",
    which restores from a full copy, with a cast per block, and the weights before the merge)."""
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 64 * 96)  # (512, 96): 8 blocks of 64 rows
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(96, 512)}).to(dtype)
    sd = {k: v.to(dtype) for k, v in lora_sd(model, rank=4).items()}
    before = state_bits(model)
    down = sd["a.lora_A.weight"]
    casts = []
    to = torch.Tensor.to

    def counting(self, *args, **kwargs):
        if self.data_ptr() == down.data_ptr() and self.dtype == dtype:
            casts.append(args)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counting)
    handle = loraweave.apply(model, sd, mode="merge", undo="compact")
    assert len(casts) == 1
    merged = state_bits(model)
    handle.remove()
    assert len(casts) == 2
    assert_same_bits(model, before)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(lora_family, "cast_once", lambda t, d: t.to(d))  # a cast per block, as before
    copy_handle = loraweave.apply(model, sd, mode="merge", undo="copy")
    assert_same_bits(model, merged)  # the same W' as with one cast per layer
    copy_handle.remove()
    assert_same_bits(model, before)
