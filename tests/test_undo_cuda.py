"""Undo records of CUDA weights live in pinned host memory (issue 15), never on the accelerator unless asked.

Runs only where CUDA is present (scripts/device_check.sh runs it on a lent GPU); the CPU cases of the same
records are in test_undo_records.py."""

from __future__ import annotations

import pytest
import torch
from helpers.undo_models import assert_same_bits, kinds_of, lora_sd, net, state_bits

import loraweave

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _record_tensors(record) -> list[torch.Tensor]:
    return [v for v in vars(record).values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["compact", "copy", "auto"])
@pytest.mark.parametrize("on_device", [False, True])
def test_cuda_records_placement_and_exact_undo(dtype, kind, on_device):
    model = net(dtype).cuda()
    before = state_bits(model)
    free_before = torch.cuda.memory_allocated()
    handle = loraweave.apply(
        model, (lora_sd(net(dtype)), 1.0), mode="merge", undo=kind, undo_on_device=on_device
    )
    assert kinds_of(handle) <= {"compact", "copy"}
    tensors = [t for m in handle.merged_layers for t in _record_tensors(m.record)]
    assert tensors, "no record tensors to check"
    for t in tensors:
        if on_device:
            assert t.device.type in ("cuda", "cpu")  # guards stay on the host either way
        else:
            assert t.device.type == "cpu", f"record tensor on {t.device}"
            assert t.is_pinned() or t.numel() == 0
    if not on_device:  # nothing but the merged weights (same storage) on the accelerator
        assert torch.cuda.memory_allocated() - free_before < 1 << 20
    handle.set_strength(handle.report.adapters[0]["name"], -0.5)
    handle.remove()
    assert_same_bits(model, before)
