"""undo="none" without a record: a merge whose ΔW is bounded (the family's declared delta_bound) below the
dtype's overflow headroom is written at commit (MergedModule.fuse), with no compare, no scan and no finite
check.

References: the bits of the same merge through the checked paths (undo="copy", the buffered path), an fp64
formula for the bound, and torch's own rounding for the headroom. Each test names how it would fail."""

from __future__ import annotations

import math
import signal

import pytest
import torch
from helpers.common import gen
from helpers.undo_models import assert_same_bits, kinds_of, lora_sd, state_bits
from torch import nn

import loraweave
import loraweave.mechanisms.merge.layer as layer_mod
from loraweave.engine.interrupts import interrupts_held
from loraweave.errors import NonFiniteResultError
from loraweave.families import lora
from loraweave.mechanisms.merge import direct as direct_mod
from loraweave.mechanisms.merge import inplace as inplace_mod
from loraweave.mechanisms.merge.checks import overflow_headroom


def two_layers(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(48, 70), "b": nn.Linear(70, 48, bias=False)}).to(dtype)


def counted(monkeypatch, module, name: str) -> dict:
    calls = {"n": 0}
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_bounded_none_merge_is_written_directly_with_the_checked_bits(monkeypatch, dtype):
    model, ref = two_layers(dtype), two_layers(dtype)
    sd = lora_sd(model, rel=0.3)
    direct = counted(monkeypatch, layer_mod, "merge_direct")
    scans = counted(monkeypatch, inplace_mod, "differ")
    handle = loraweave.apply(model, (sd, 2.0), mode="merge", undo="none", strict=True)
    loraweave.apply(ref, (sd, 2.0), mode="merge", undo="copy")
    assert direct["n"] == 2 and scans["n"] == 0  # both layers took the direct path, nothing was compared
    assert kinds_of(handle) == {"none"} and handle.report.undo_bytes() == 0
    assert_same_bits(model, state_bits(ref))  # the same blocks and arithmetic: the same bits


def test_a_failing_layer_leaves_the_deferred_layers_unwritten():
    """Layer a is bounded (deferred), layer b overflows fp16 (checked path, raises): nothing may be written.
    Fails if the direct path wrote at install time (a would hold W' with no record to undo it)."""
    model = two_layers(torch.float16)
    before = state_bits(model)
    sd = lora_sd(model, rel=0.3)
    sd["b.lora_A.weight"] = torch.ones_like(sd["b.lora_A.weight"])
    sd["b.lora_B.weight"] = torch.full_like(sd["b.lora_B.weight"], 3e4)
    with pytest.raises(NonFiniteResultError, match="non-finite"):
        loraweave.apply(model, sd, mode="merge", undo="none")
    assert_same_bits(model, before)


def test_a_bound_above_the_headroom_takes_the_checked_path(monkeypatch):
    """Rows of norm 64 against orthogonal columns: the bound (64) exceeds fp16's headroom (8), the true ΔW is
    0 on most rows; the merge still lands, through the checked path."""
    model = two_layers(torch.float16)
    sd = lora_sd(model, rel=0.3)
    up = torch.zeros(70, 2)
    up[0, 0] = 64.0
    down = torch.zeros(2, 48)
    down[1, 0] = 1.0  # up row 0 meets only down row 0, which is zero: ΔW = 0, bound = 64·1
    sd["a.lora_B.weight"], sd["a.lora_A.weight"] = up, down
    direct = counted(monkeypatch, layer_mod, "merge_direct")
    handle = loraweave.apply(model, sd, mode="merge", undo="none", strict=True)
    assert direct["n"] == 1  # layer b only
    assert kinds_of(handle) == {"none"}


def test_interrupt_during_the_commit_is_delivered_after_every_layer_is_written(monkeypatch):
    """Ctrl-C while the first deferred layer is written: the other one is written too, then it arrives."""
    model, ref = two_layers(torch.float32), two_layers(torch.float32)
    sd = lora_sd(model, rel=0.3)
    real = inplace_mod.merge_direct
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(layer_mod, "merge_direct", interrupted)
    # Python's own handler, even where the runner ignores SIGINT (a job a shell started in the background)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            loraweave.apply(model, sd, mode="merge", undo="none")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert calls["n"] == 2
    loraweave.apply(ref, sd, mode="merge", undo="copy")
    assert_same_bits(model, state_bits(ref))


def test_interrupts_held_delivers_once_to_the_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    try:
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "dtype",
    [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=str,
)
def test_headroom_is_a_quarter_ulp_at_the_largest_value_and_twice_it_stays_finite(dtype):
    """x = max, d = 2·headroom (half an ulp there, less a hair): round(x + d) is finite; the tie (IEEE types:
    rounded to the even neighbour beyond max, inf) and a full ulp are not (e4m3fn casts saturate: never)."""
    info = torch.finfo(dtype)
    ulp = math.ldexp(info.eps, math.frexp(info.max)[1] - 1)
    assert overflow_headroom(dtype) == ulp / 4
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # the merge's accumulation dtype
    top = torch.tensor([info.max], dtype=torch.float64)
    below = (top + 2 * overflow_headroom(dtype) * (1 - 2**-10)).to(acc).to(dtype)
    assert torch.isfinite(below.double()).all()
    beyond = [] if dtype == torch.float8_e4m3fn else [ulp / 2, ulp]  # torch saturates e4m3fn casts at 448
    for step in beyond:
        assert not torch.isfinite((top + step).to(acc).to(dtype).double()).all(), step


def test_lora_delta_bound_holds_and_is_tight_on_rank_one():
    g = gen(3)
    up, down = torch.randn(40, 6, generator=g), torch.randn(6, 30, generator=g)
    f = lora.LoraFactors(down, up, None, 6, False)
    delta = (up.double() @ down.double()).abs()
    assert delta[5:17].max() <= lora.delta_bound(f, 5, 12) * (1 + 1e-12)
    u, d = torch.randn(40, 1, generator=g), torch.randn(1, 30, generator=g)
    one = lora.LoraFactors(d, u, None, 1, False)
    assert lora.delta_bound(one, 0, 40) == pytest.approx(float((u.double() @ d.double()).abs().max()))
    bad = lora.LoraFactors(down, up.clone().index_fill_(0, torch.tensor([3]), float("nan")), None, 6, False)
    assert not lora.delta_bound(bad, 0, 40) < math.inf  # nan: never "under the headroom"


def test_lora_set_delta_writes_what_add_delta_adds_to_zeros():
    """The first term of a block is written (beta=0), not added to a zeroed block: the same bits but the sign
    of a zero (a zero row times a negative coefficient: MKL on Intel Xeon gives -0.0 with beta=0, on AMD EPYC
    +0.0; merge and undo compute ΔW the same way, so that sign never breaks a record); what the block held
    (NaN here) is never read."""
    g = gen(4)
    up, down = torch.randn(50, 8, generator=g), torch.randn(8, 40, generator=g)
    up[3] = 0.0
    f = lora.LoraFactors(down, up, None, 8, False)
    added = torch.zeros(20, 40)
    lora.add_delta(added, f, 0, 20, -0.7)
    written = torch.full((20, 40), float("nan"))
    lora.set_delta(written, f, 0, 20, -0.7)
    assert not written.isnan().any()
    # -0.0 + 0.0 = +0.0: the zeros' signs made equal
    assert torch.equal((written + 0.0).view(torch.int32), (added + 0.0).view(torch.int32))


def fused_spy(monkeypatch) -> dict:
    """Counts the blocks delta.fused_adder's adds write (and the adders made, None included)."""
    calls = {"made": 0, "blocks": 0}
    real = layer_mod.fused_adder

    def made(*args):
        calls["made"] += 1
        fused = real(*args)
        if fused is None:
            return None

        def counted_add(*a):
            wrote = fused(*a)
            calls["blocks"] += wrote
            return wrote

        return counted_add

    monkeypatch.setattr(layer_mod, "fused_adder", made)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fp32_none_merge_adds_each_block_in_one_pass_with_the_checked_bits(monkeypatch, dtype):
    """fp32/fp64 weights, one LoRA a layer: every block is written by one addmm_ (no ΔW buffer), with the
    bits of the checked path (ΔW rounded, then one add). Fails if the fused add did not run, or if the BLAS
    fused its product into the add (then blas_rounds_product must have said so)."""
    model, ref = two_layers(dtype), two_layers(dtype)
    sd = lora_sd(model, rel=0.3)
    fused = fused_spy(monkeypatch)
    loraweave.apply(model, (sd, 1.7), mode="merge", undo="none", strict=True)
    loraweave.apply(ref, (sd, 1.7), mode="merge", undo="copy")
    assert fused["made"] == 2 and fused["blocks"] == 2
    assert_same_bits(model, state_bits(ref))


def test_without_a_rounding_blas_the_none_merge_takes_the_two_step_write(monkeypatch):
    """Where the probe finds that the BLAS fuses alpha·(up @ down) into the add, no fused add is made and the
    two-step write (ΔW, then one add) gives the checked bits."""
    from loraweave.mechanisms.merge import delta as delta_mod

    monkeypatch.setattr(delta_mod, "blas_rounds_product", lambda dtype: False)
    model, ref = two_layers(torch.float32), two_layers(torch.float32)
    sd = lora_sd(model, rel=0.3)
    fused = fused_spy(monkeypatch)
    combines = counted(monkeypatch, direct_mod, "combine_into")
    loraweave.apply(model, sd, mode="merge", undo="none", strict=True)
    loraweave.apply(ref, sd, mode="merge", undo="copy")
    assert fused == {"made": 2, "blocks": 0} and combines["n"] == 2
    assert_same_bits(model, state_bits(ref))


def test_fused_add_writes_only_the_blocks_its_term_covers():
    """A LoRA on rows [4, 12) of 16 (a fused layer's middle part): the blocks it covers whole are added in
    place, the others left to the two-step write, which turns -0.0 into +0.0 there (W + 0) as every other
    path does. Compared with rows_delta + combine_into block by block."""
    from types import SimpleNamespace

    from loraweave.arch.spec import Piece
    from loraweave.families.lora import SPEC, LoraFactors
    from loraweave.mechanisms.merge.delta import delta_fn, fused_adder
    from loraweave.mechanisms.merge.undo import combine_into

    g = gen(5)
    w = torch.randn(16, 24, generator=g)
    w[0, :3] = -0.0
    w[13, :3] = -0.0
    factors = LoraFactors(torch.randn(3, 24, generator=g), torch.randn(8, 3, generator=g), None, 3, False)
    terms = [(SimpleNamespace(family=SPEC, factors=factors), Piece("m", 0, 4, 8, False), 1.0, 0.6)]
    fused, delta = fused_adder(terms, w), delta_fn(terms)
    assert fused is not None
    got, want = w.clone(), w.clone()
    written = []
    for r0 in range(0, 16, 4):
        written.append(fused(got, r0, r0 + 4))
        if not written[-1]:
            combine_into(got[r0 : r0 + 4], got[r0 : r0 + 4], delta(got, r0, r0 + 4), 1, torch.empty(4, 24))
        block = want[r0 : r0 + 4]
        combine_into(block, block, delta(want, r0, r0 + 4), 1, torch.empty(4, 24))
    assert written == [False, True, True, False]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert not torch.equal(got[4:12], w[4:12])  # the covered rows were written
    assert (got.view(torch.int32)[0, :3] == 0).all() and (got.view(torch.int32)[13, :3] == 0).all()  # +0.0
