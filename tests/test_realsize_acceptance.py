"""Issue 28's acceptance cases: real adapter files merged into full-size models, only the touched layers
materialized (the rest stay on the meta device).

- leighwoods' Flux LoRA (ai-toolkit, PEFT names, rank 16 fp16, no alpha: scale 1) on its 4 single-block
  proj_out layers (3072x15360 = 47.2M elements each) of a bf16 Flux.1 transformer: the default merge raised
  IndexError on 2cef893^ (compact undo's float32 witness positions ran past the end above 2**24 elements).
- KohakuBlueleaf's LoKr (early LyCORIS, kohya names, both Kronecker halves low-rank, alpha 4 / rank 4) on a
  fp16 SD1.5 UNet: the file's parts on the 6 up-block 3x3 convs above 2**24 elements (1280x2560x3x3 = 29.5M,
  1280x1920x3x3), the layers that crashed; the whole file on a whole UNet is test_realsize_sd15's.

Merged rows (every 97th plus the last) match the fp64 formula (W + B·A; W + γ·kron(w1, w2) on the flattened
weight) to one ulp of the layer dtype; `remove()` restores every bit (regenerated from the seed)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.realsize import (
    assert_rows_match,
    assert_seeded,
    materialized,
    meta_denoiser,
    sample_rows,
)
from safetensors.torch import load_file

import loraweave

# 2 threads on 2 shared cores spin in OpenMP barriers: ~10x a merge's CPU time (and wall time) under load
pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 11
LEIGHWOODS = "lora/leighwoods__public-loras__lora.safetensors"
LOKR = "lora/KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"


def test_leighwoods_flux_lora_merges_into_full_size_bf16_proj_out(realdata):
    path = realdata / LEIGHWOODS
    tensors = load_file(path)
    blocks = sorted({int(m.group(1)) for k in tensors if (m := re.search(r"blocks\.(\d+)\.", k))})
    assert blocks == [7, 12, 16, 20]
    model = meta_denoiser("flux").to(torch.bfloat16)
    paths = [f"single_transformer_blocks.{n}.proj_out" for n in blocks]
    with materialized(model, paths, torch.bfloat16, SEED):
        weights = [model.get_submodule(p).weight for p in paths]
        assert all(tuple(w.shape) == (3072, 15360) for w in weights)
        rows = sample_rows(3072)
        originals = [w.detach()[rows].clone() for w in weights]
        handle = loraweave.apply(model, str(path), mode="merge", strict=True)
        assert sorted(m.module for m in handle.report.applied) == sorted(paths)
        assert {m.undo for m in handle.report.applied} == {"compact"}  # the record that crashed
        for p, w, original in zip(paths, weights, originals, strict=True):
            a = tensors[f"transformer.{p}.lora_A.weight"].double()
            b = tensors[f"transformer.{p}.lora_B.weight"].double()[rows]
            expect = original.double() + b @ a
            assert_rows_match(w.detach()[rows], expect, b.abs() @ a.abs(), torch.bfloat16, 16, p)
        handle.remove()
        for i, (p, w) in enumerate(zip(paths, weights, strict=True)):
            assert_seeded(w, SEED + i, f"{p} after remove()")


def kron_rows(w1: torch.Tensor, w2: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of kron(w1, w2): row i·b + k is w1[i] ⊗ w2[k] (b = w2's rows)."""
    b = w2.shape[0]
    return torch.stack([torch.kron(w1[r // b], w2[r % b]) for r in rows.tolist()])


def _kohya(path: str) -> str:
    return "lora_unet_" + path.replace(".", "_")


def test_lycoris_lokr_merges_into_full_size_sd15_up_block_convs(realdata):
    tensors = load_file(realdata / LOKR)
    model = meta_denoiser("sd1").to(torch.float16)
    paths = [
        p
        for p, m in model.named_modules()
        if isinstance(m, torch.nn.Conv2d) and m.weight.numel() > 2**24 and f"{_kohya(p)}.alpha" in tensors
    ]
    assert len(paths) == 6, paths
    parts = {k: v for k, v in tensors.items() if k.split(".")[0] in {_kohya(p) for p in paths}}
    with materialized(model, paths, torch.float16, SEED):
        weights = [model.get_submodule(p).weight for p in paths]
        rows = sample_rows(1280)
        originals = [w.detach()[rows].clone() for w in weights]
        handle = loraweave.apply(model, parts, mode="merge", strict=True)
        assert sorted(m.module for m in handle.report.applied) == sorted(paths)
        for p, w, original in zip(paths, weights, originals, strict=True):
            f = {k.split(".")[1]: v.double() for k, v in parts.items() if k.startswith(_kohya(p) + ".")}
            gamma = float(f["alpha"]) / f["lokr_w1_a"].shape[1]  # LyCORIS: alpha over the first half's rank
            w1, w2 = f["lokr_w1_a"] @ f["lokr_w1_b"], f["lokr_w2_a"] @ f["lokr_w2_b"]
            assert w1.shape[0] * w2.shape[0] == 1280 and w1.shape[1] * w2.shape[1] == w[0].numel()
            m1, m2 = f["lokr_w1_a"].abs() @ f["lokr_w1_b"].abs(), f["lokr_w2_a"].abs() @ f["lokr_w2_b"].abs()
            expect = original.reshape(len(rows), -1).double() + gamma * kron_rows(w1, w2, rows)
            # fp32 error: two rank-4 sums and their product, on Σ|terms|
            magnitude = gamma * kron_rows(m1, m2, rows)
            assert_rows_match(w.detach()[rows], expect, magnitude, torch.float16, 8, p)
        handle.remove()
        for i, (p, w) in enumerate(zip(paths, weights, strict=True)):
            assert_seeded(w, SEED + i, f"{p} after remove()")
