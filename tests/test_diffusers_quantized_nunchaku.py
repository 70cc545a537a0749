"""A Nunchaku SVDQuant W4A4 transformer through the diffusers drop-in (issue 38, item 4).

The base: Nunchaku's real NunchakuZImageTransformer2DModel (helpers.diffusers_quant.nunchaku_zimage: patched
by its own `_patch_model`, each SVDQW4A4Linear filled from a seeded weight by nunchaku's packer), bf16, on the
CPU stand-in for `nunchaku._C` (helpers.nunchaku_cpu), in diffusers' ZImagePipeline with
`loraweave.diffusers.enable`. Files name Nunchaku's own modules (fused `to_qkv`, fused SwiGLU `net.0.proj`).

- `load_lora_weights` (LoRA, LoKr, LoHa, DoRA, OFT): runtime on every SVDQ layer; output = the base's own
  output + the exact fp64 term, ΔW on the layer's own weight (int4 residual / smooth + up·down, unpacked by
  the tests' unpackers); bound per element (helpers.diffusers_quant.check_term): ‖G − I‖∞·e_base (the
  base's own W4A4 error, carried by DoRA's gain and OFT's rotation; 0 for additive families) + ½ulp(y) +
  2u·max|term|, u = 2⁻⁸. Bytes of every tensor unchanged while loaded and after unload.
- `fuse_lora` of a plain LoRA: the factors go into the layer's own low-rank branch (rank 32 → 48, the
  rank-4 LoRA padded to the kernel's 16-rank tile; no hook; the same `nunchaku._C` calls per forward as
  without the LoRA). Stored: exactly bf16(A) and bf16(s·B) (the branch's own precision); output = base + the
  stored factors' term within ½ulp(y) + ½ulp(y_base) + u·|x·Aᵀ|·|s·B|ᵀ (the branch rounds x·Aᵀ to 16 bits,
  then y is rounded). `unfuse_lora` puts back the same Parameter objects, bit for bit, and rank 32."""

from __future__ import annotations

import pytest
import torch
from helpers import nunchaku_cpu
from helpers.diffusers_quant import (
    FAMILIES,
    NUNCHAKU_TARGETS,
    adapter,
    baseline,
    changed_bytes,
    check_term,
    kohya_names,
    nunchaku_zimage,
    storage_bytes,
    ulp,
    zimage_pipe,
)

import loraweave.diffusers as lwd

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
U = 2.0**-8


@pytest.fixture(scope="module")
def model():
    return nunchaku_zimage()


@pytest.fixture
def pipe(model):
    before, objects = storage_bytes(model), nunchaku_cpu.storage(model)
    pipe = lwd.enable(zimage_pipe(model))
    yield pipe
    lwd.disable(pipe)
    assert changed_bytes(model, before) == []
    nunchaku_cpu.assert_storage(model, objects)  # the same Parameter objects, bytes and ranks; no hooks


@pytest.mark.parametrize("family", FAMILIES)
def test_dropin_runs_every_family_exactly_beside_svdquant(model, pipe, family):
    base, before = baseline(model, NUNCHAKU_TARGETS, torch.bfloat16), storage_bytes(model)
    sd, deltas = adapter(family, model, targets=NUNCHAKU_TARGETS)
    pipe.load_lora_weights(kohya_names(sd), adapter_name=family)
    report = pipe.loraweave_reports[family]
    assert report.keys_applied == report.keys_total == len(sd)
    assert {a.module: a.mechanism for a in report.applied} == dict.fromkeys(NUNCHAKU_TARGETS, "runtime")
    assert changed_bytes(model, before) == []
    for path, (x, b) in base.items():
        ratio = check_term(model.get_submodule(path), x, b, deltas[path])
        assert ratio <= 1, (family, path, ratio)
    pipe.unload_lora_weights()
    assert changed_bytes(model, before) == []
    with torch.no_grad():
        for path, (x, (y, _, _)) in base.items():
            assert torch.equal(model.get_submodule(path)(x), y), (family, path)


def test_fuse_lora_rides_the_low_rank_branch(model, pipe):
    base = baseline(model, NUNCHAKU_TARGETS, torch.bfloat16)
    sd, deltas = adapter("lora", model, targets=NUNCHAKU_TARGETS)
    plain_calls = _calls(model, base)
    pipe.load_lora_weights(sd, adapter_name="lora")
    pipe.fuse_lora()
    for path in NUNCHAKU_TARGETS:
        layer = model.get_submodule(path)
        assert layer.rank == layer.proj_up.shape[1] == 32 + 16, path  # padded to the kernel's 16-rank tiles
        assert not layer._forward_hooks and not layer._forward_pre_hooks, path
    assert _calls(model, base) == plain_calls  # the appended rank runs inside the same fused GEMM calls
    with torch.no_grad():
        for path, (x, (y0, _, _)) in base.items():
            layer = model.get_submodule(path)
            down = sd[f"{path}.lora_down.weight"]
            up = sd[f"{path}.lora_up.weight"] * 0.5  # alpha 2 / rank 4
            # what the branch stores: exactly bf16(A) and bf16(s·B), zero-padded to the 16-rank tile
            stored_down = nunchaku_cpu.unpack_lowrank(layer.proj_down.detach(), down=True)[32:]
            stored_up = nunchaku_cpu.unpack_lowrank(layer.proj_up.detach(), down=False)[:, 32:]
            assert torch.equal(stored_down[:4], down.bfloat16()) and not stored_down[4:].any(), path
            assert torch.equal(stored_up[:, :4], up.bfloat16()) and not stored_up[:, 4:].any(), path
            # the output: the stored factors' term, with the branch's one 16-bit rounding of x·Aᵀ and the
            # final roundings of y and of the base's y0
            act = x.double() @ stored_down[:4].double().T
            term = act @ stored_up[:, :4].double().T
            y = layer(x).double()
            bound = (
                0.5 * ulp(y, torch.bfloat16)
                + 0.5 * ulp(y0, torch.bfloat16)
                + U * act.abs() @ stored_up[:, :4].double().abs().T
            )
            ratio = float(((y - y0.double() - term).abs() / bound).max())
            assert ratio <= 1, (path, ratio)
    pipe.unfuse_lora()
    for path in NUNCHAKU_TARGETS:
        assert model.get_submodule(path).rank == 32, path
    pipe.unload_lora_weights()


def _calls(model, base) -> dict[str, int]:
    """The `nunchaku._C` op calls of one forward of every target layer."""
    nunchaku_cpu.CALLS.clear()
    with torch.no_grad():
        for path, (x, _) in base.items():
            model.get_submodule(path)(x)
    return dict(nunchaku_cpu.CALLS)
