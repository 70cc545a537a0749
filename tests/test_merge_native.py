"""The native fused-merge kernel (mechanisms/merge/fused_record.c via native.py) against the torch path.

Reference: the same merge with the kernel switched off (inplace.kernel_for -> None), whose bits and compact
records are proven by test_merge_in_place and test_undo_records. The kernel must write the same W' bits (NaN
payloads aside: torch patterns NaN its own way; such elements are always misses), a record that restores W bit
for bit, and leave the weight unchanged after any failure, including an interrupt right after a block."""

from __future__ import annotations

import ctypes
import logging

import pytest
import torch
from helpers.common import fail_on_call, gen
from helpers.undo_models import assert_same_bits, kinds_of, lora_sd, state_bits
from torch import nn

import loraweave
import loraweave.mechanisms.merge.layer as layer_mod
from loraweave.errors import NonFiniteResultError
from loraweave.mechanisms.merge import inplace as inplace_mod
from loraweave.mechanisms.merge import native
from loraweave.mechanisms.merge.undo import bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def built():
    """Every test here needs the kernels: CI machines have a C compiler (a missing one is a failure, not a
    skip)."""
    for dtype in DTYPES:
        assert native.kernel_for(dtype) is not None, f"no native kernel for {dtype}"


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(layer_mod, "CHUNK_ELEMENTS", 300)


def adapter_for(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A LoRA sized against the clean weights (the specials would make every norm inf)."""
    return lora_sd(hostile(dtype, specials=False), rel=0.3)


def hostile(dtype: torch.dtype, rows: int = 70, cols: int = 48, specials: bool = True) -> nn.Module:
    """Weights with what rounding and overflow hide in: signed zeros, subnormals, values at the dtype's
    largest, infinities and NaN (these stay what they were: a merge only adds a finite ΔW)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(cols, rows), "b": nn.Linear(rows, cols, bias=False)}).to(dtype)
    info = torch.finfo(dtype)
    special = [
        -0.0,
        0.0,
        info.tiny / 4,
        -info.tiny / 2,
        info.max,
        -info.max,
        float("inf"),
        float("nan"),
        1e-3,
    ]
    if specials:
        with torch.no_grad():
            model.a.weight.view(-1)[7 : 7 + len(special)] = torch.tensor(special).to(dtype)
    return model


def merged_without_kernel(monkeypatch, model: nn.Module, sd, **kw) -> dict[str, torch.Tensor]:
    with monkeypatch.context() as m:
        m.setattr(inplace_mod, "kernel_for", lambda dtype: None)
        handle = loraweave.apply(model, sd, mode="merge", **kw)
    merged = state_bits(model)
    handle.remove()
    return merged


def same_bits_but_nan(now: dict, ref: dict, dtype: torch.dtype) -> None:
    for k, v in now.items():
        a, b = v.view(dtype).float(), ref[k].view(dtype).float()
        both_nan = torch.isnan(a) & torch.isnan(b)
        assert torch.equal(torch.isnan(a), torch.isnan(b)), k
        assert torch.equal(v[~both_nan], ref[k][~both_nan]), f"{k}: W' differs from the torch path"


@pytest.mark.parametrize("kind", ["auto", "compact"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_writes_the_torch_paths_bits_and_restores_exactly(monkeypatch, small_blocks, kind, dtype):
    model = hostile(dtype)
    before = state_bits(model)
    sd = (adapter_for(dtype), 2.0)
    reference = merged_without_kernel(monkeypatch, model, sd, undo=kind)
    assert_same_bits(model, before)
    calls = {"n": 0}
    real = native.kernel_for(dtype)

    def counting(*args):
        calls["n"] += 1
        return real.fn(*args)

    counted = native.Kernel(dtype, counting)
    monkeypatch.setattr(inplace_mod, "kernel_for", lambda dt: counted if dt == dtype else None)
    handle = loraweave.apply(model, sd, mode="merge", undo=kind)
    assert calls["n"] >= 6  # both layers, 3 blocks each, went through the kernel
    same_bits_but_nan(state_bits(model), reference, dtype)
    assert kinds_of(handle) <= ({"compact"} if kind == "compact" else {"compact", "copy"})
    handle.set_strength(handle.report.adapters[0]["name"], -0.5)
    same_bits_but_nan(
        state_bits(model), merged_without_kernel_at(monkeypatch, dtype, sd[0], -0.5, kind), dtype
    )
    handle.remove()
    assert_same_bits(model, before)


def merged_without_kernel_at(monkeypatch, dtype, sd, strength, kind, specials: bool = True) -> dict:
    model = hostile(dtype, specials=specials)
    return merged_without_kernel(monkeypatch, model, (sd, strength), undo=kind)


def test_sparse_misses_far_apart_encode_their_gaps_exactly(monkeypatch, small_blocks):
    """ΔW nonzero on three rows only: misses 300k+ positions apart (2-byte and 1-byte gaps both need fillers),
    across many blocks with no miss at all."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(512, 1024, bias=False)})
    before = state_bits(model)
    g = gen(5)
    up = torch.zeros(1024, 2)
    up[[0, 700, 1023]] = torch.randn(3, 2, generator=g)
    sd = {"a.lora_B.weight": up, "a.lora_A.weight": torch.randn(2, 512, generator=g) * 0.05}
    reference = merged_without_kernel(monkeypatch, model, sd, undo="compact")
    handle = loraweave.apply(model, sd, mode="merge", undo="compact")
    assert_same_bits(model, reference)
    record = model.a._loraweave_merges[-1].record
    assert record.encoding in ("gaps8", "gaps", "bitmask")
    positions = record.decoded_positions(model.a.weight.numel(), torch.device("cpu"))
    assert positions.numel() and bool((positions.diff() > 65535).any())
    assert set((positions // 512).unique().tolist()) <= {0, 700, 1023}
    handle.remove()
    assert_same_bits(model, before)


@pytest.mark.parametrize("after", [False, True], ids=["before-call", "after-call"])
@pytest.mark.parametrize("nth", [1, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_interrupt_around_a_kernel_call_leaves_the_weight_unchanged(
    monkeypatch, small_blocks, dtype, nth, after
):
    """after-call: the block is written and its misses sit in the kernel's buffers when Ctrl-C lands; they
    must still reach the record that puts it back."""
    model = hostile(dtype)
    before = state_bits(model)
    kernel = native.kernel_for(dtype)
    faulty = native.Kernel(dtype, fail_on_call(nth, KeyboardInterrupt, kernel.fn, after=after))
    monkeypatch.setattr(inplace_mod, "kernel_for", lambda dt: faulty if dt == dtype else None)
    with pytest.raises(KeyboardInterrupt):
        loraweave.apply(model, adapter_for(dtype), mode="merge", undo="compact")
    assert_same_bits(model, before)


def test_overflow_found_by_the_kernel_puts_every_written_block_back(small_blocks):
    model = hostile(torch.float16)
    before = state_bits(model)
    sd = adapter_for(torch.float16)
    sd["a.lora_A.weight"] = torch.ones_like(sd["a.lora_A.weight"])
    sd["a.lora_B.weight"][60:] = 3e4  # the last rows overflow: many blocks are written before them
    with pytest.raises(NonFiniteResultError, match="non-finite values in rows"):
        loraweave.apply(model, sd, mode="merge")
    assert_same_bits(model, before)


def test_without_a_compiler_the_torch_path_runs(monkeypatch, caplog, tmp_path):
    model, ref = hostile(torch.float32), hostile(torch.float32)
    sd = adapter_for(torch.float32)
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setattr(native.shutil, "which", lambda name: "/bin/false" if name == "/bin/false" else None)
    monkeypatch.setenv("LORAWEAVE_CACHE", str(tmp_path))
    native._library.cache_clear()
    native.kernel_for.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="loraweave"):
            assert native.kernel_for(torch.float32) is None
        assert "native_merge=off reason=build_failed" in caplog.text
        handle = loraweave.apply(model, sd, mode="merge")
        loraweave.apply(ref, sd, mode="merge", undo="copy")
        same_bits_but_nan(state_bits(model), state_bits(ref), torch.float32)
        handle.remove()
        monkeypatch.setenv("LORAWEAVE_NATIVE", "0")
        native._library.cache_clear()
        native.kernel_for.cache_clear()
        assert native.kernel_for(torch.float32) is None
    finally:
        native._library.cache_clear()
        native.kernel_for.cache_clear()


def test_kernel_bits_on_a_full_width_block():
    """One block of a 3072-wide layer straight through the kernel, against torch's add and round (fp32,
    bf16)."""
    g = gen(7)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.rand(85, 3072, generator=g) - 0.5).to(dtype)
        d = torch.randn(85, 3072, generator=g) * 1e-3
        expect = (w.float() + d).to(dtype)
        guess = (expect.float() - d).to(dtype)
        miss = (bits(guess) != bits(w)).view(-1).nonzero().squeeze(1)
        wb = bits(w).view(-1).clone()
        kernel = native.kernel_for(dtype)
        gaps = torch.zeros(w.numel() + w.numel() // 255 + 2, dtype=torch.uint8)
        vals, guard = wb.new_zeros(w.numel()), torch.zeros(9, dtype=torch.int64)
        gw, gm = wb.new_zeros(8), wb.new_zeros(8)
        state = torch.tensor([-1, 0, -1, 0, 0], dtype=torch.int64)
        k = kernel.fn(wb.data_ptr(), d.data_ptr(), w.numel(), 0, gaps.data_ptr(), vals.data_ptr(),
                      guard.data_ptr(), gw.data_ptr(), gm.data_ptr(), state.data_ptr())  # fmt: skip
        assert torch.equal(wb, bits(expect).view(-1))
        assert k == miss.numel() == int(state[0]) and int(state[1]) == 0
        steps = gaps[: int(state[3])].long()
        decoded = (torch.where(steps == 0, 255, steps).cumsum(0) - 1)[steps != 0]  # zeros: fillers of 255
        assert torch.equal(decoded, miss)
        assert torch.equal(vals[:k], bits(w).view(-1)[miss])
        differs = (bits(expect) != bits(w)).view(-1).nonzero().squeeze(1)[:8]
        assert torch.equal(guard[1 : 1 + int(guard[0])], differs)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_a_strength_change_that_overflows_leaves_the_merge_as_it_was(monkeypatch, small_blocks, path):
    """The compact rewrite rebuilds W and merges again in a scratch copy: an overflow there must leave the
    weight at the old W' and the old record able to restore W bit for bit."""
    if path == "torch":
        monkeypatch.setattr(inplace_mod, "kernel_for", lambda dtype: None)
    model = hostile(torch.float16, specials=False)
    before = state_bits(model)
    sd = adapter_for(torch.float16)
    sd["a.lora_B.weight"] = sd["a.lora_B.weight"] * 1000  # |ΔW| ~ 30 at strength 1, past 65504 at 10000
    handle = loraweave.apply(model, sd, mode="merge", undo="compact")
    merged, name = state_bits(model), handle.report.adapters[0]["name"]
    with pytest.raises(NonFiniteResultError):
        handle.set_strength(name, 1e4)
    assert_same_bits(model, merged)
    handle.set_strength(name, -0.5)
    got = state_bits(model)
    expected = merged_without_kernel_at(monkeypatch, torch.float16, sd, -0.5, "compact", False)
    same_bits_but_nan(got, expected, torch.float16)
    handle.remove()
    assert_same_bits(model, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_portable_build_agrees_with_the_native_one(dtype):
    """The kernels without AVX-512 (the scalar slices a machine without it builds) against this machine's
    build: the same W' bits, gap entries, values and counts on a block with specials, over 2^16 elements."""
    portable = native.load(
        ("-O2", "-march=x86-64", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
    )
    assert portable is not None
    g = gen(11)
    w = (torch.randn(70000, generator=g) * 0.05).to(dtype)
    info = torch.finfo(dtype)
    w[:9] = torch.tensor(
        [-0.0, 0.0, info.tiny / 4, info.max, -info.max, float("inf"), float("nan"), 1.0, -1.0]
    )
    d = torch.randn(70000, generator=g) * 1e-3
    d[3] = info.max  # overflow: a new non-finite value
    outs = []
    for kernel in (native.bind(portable, dtype), native.kernel_for(dtype)):
        wb = bits(w).clone()
        gaps = torch.zeros(w.numel() * 2, dtype=torch.uint8)
        vals, guard = wb.new_zeros(w.numel()), torch.zeros(9, dtype=torch.int64)
        gw, gm = wb.new_zeros(8), wb.new_zeros(8)
        state = torch.tensor([-1, 0, -1, 0, 0], dtype=torch.int64)
        k = kernel.fn(wb.data_ptr(), d.data_ptr(), w.numel(), 5, gaps.data_ptr(), vals.data_ptr(),
                      guard.data_ptr(), gw.data_ptr(), gm.data_ptr(), state.data_ptr())  # fmt: skip
        outs.append((wb, gaps[: int(state[3])], vals[:k], state, guard, gw, gm))
    (wp, *rest_p), (wn, *rest_n) = outs
    nan = torch.isnan(wp.view(dtype).float())
    assert torch.equal(nan, torch.isnan(wn.view(dtype).float())) and torch.equal(wp[~nan], wn[~nan])
    for a, b in zip(rest_p, rest_n, strict=True):
        assert torch.equal(a, b)
    assert int(outs[0][3][1]) >= 1  # the overflow was counted


def test_an_unwritable_cache_folder_builds_in_the_temp_dir(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(native, "_cache_dir", lambda: blocker / "native")  # mkdir under a file fails
    lib = native.load(("-O1", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared"))
    assert lib is not None and native.bind(lib, torch.float32) is not None


PORTABLE = ("-O2", "-march=x86-64", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "changed", [[], [4095], [6149], [1, 2049, 2050, 4100, 6143], list(range(3, 6151, 601))]
)
def test_kernel_guards_where_few_elements_change(dtype, changed, build):
    """ΔW zero except at a few positions (a zero LoRA, rows outside a fused part): the guards are the first 8
    changed positions with W's and W''s bits, found across slices (2048 elements), in a block's unaligned
    tail, and none where nothing changes; with and without AVX-512. Against torch's add and round."""
    kernel = native.kernel_for(dtype) if build == "native" else native.bind(native.load(PORTABLE), dtype)
    n = 6151  # 3 slices and an unaligned tail
    w = (torch.rand(n, generator=gen(3)) + 0.5).to(dtype)
    d = torch.zeros(n)
    d[changed] = 0.25
    expect = (w.float() + d).to(dtype)
    wb = bits(w).clone()
    gaps = torch.zeros(n + n // 255 + 2, dtype=torch.uint8)
    vals, guard = wb.new_zeros(n), torch.zeros(9, dtype=torch.int64)
    gw, gm = wb.new_zeros(8), wb.new_zeros(8)
    state = torch.tensor([-1, 0, -1, 0, 0], dtype=torch.int64)
    kernel.fn(wb.data_ptr(), d.data_ptr(), n, 0, gaps.data_ptr(), vals.data_ptr(),
              guard.data_ptr(), gw.data_ptr(), gm.data_ptr(), state.data_ptr())  # fmt: skip
    assert torch.equal(wb, bits(expect))
    differs = (bits(expect) != bits(w)).nonzero().squeeze(1)[:8]
    assert differs.tolist() == changed[:8]  # the data changes what the test says it does
    g = int(guard[0])
    assert torch.equal(guard[1 : 1 + g], differs)
    assert torch.equal(gw[:g], bits(w)[differs]) and torch.equal(gm[:g], bits(expect)[differs])


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_pass_combine_writes_torchs_three_pass_bits(dtype, sign, build):
    """undo.combine_into for 16-bit weights in one native pass (a record's rebuild, the direct write) against
    torch's exact upcast, fp32 add and one rounding: the same bits on random values and on signed zeros,
    subnormals, the largest value, infinities, NaN and an overflow, in place and into another buffer; NaN
    where torch has NaN (its payload is not compared, as elsewhere)."""
    from loraweave.mechanisms.merge import undo as undo_mod

    if build == "native":
        one_pass = native.combine_for(dtype)
    else:
        lib = native.load(PORTABLE)
        one_pass = getattr(lib, {torch.bfloat16: "lw_combine_bf16", torch.float16: "lw_combine_f16"}[dtype])
        one_pass.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int32]
    g = gen(17)
    info = torch.finfo(dtype)
    w = (torch.randn(4099, generator=g) * 0.05).to(dtype)
    w[:9] = torch.tensor(
        [-0.0, 0.0, info.tiny / 4, -info.tiny / 2, info.max, -info.max, *[float("inf")] * 2, 1]
    )
    w[9] = float("nan")
    d = torch.randn(4099, generator=g) * 1e-3
    d[:4] = torch.tensor([0.0, -0.0, info.tiny / 8, 0.0])
    d[7] = -sign * float("inf")  # inf - inf: NaN
    w[8], d[8] = info.max, sign * info.max  # max + max: overflows to inf
    expect = (w.float() + sign * d).to(dtype)
    out = torch.empty_like(w)
    one_pass(w.data_ptr(), d.data_ptr(), out.data_ptr(), w.numel(), sign)
    same_bits_but_nan({"w": bits(out)}, {"w": bits(expect)}, dtype)
    inplace = w.clone()
    one_pass(inplace.data_ptr(), d.data_ptr(), inplace.data_ptr(), w.numel(), sign)
    same_bits_but_nan({"w": bits(inplace)}, {"w": bits(expect)}, dtype)
    assert torch.isinf(expect[8].float()) and torch.isnan(expect[7].float())  # the specials did what they say
    via = torch.empty_like(w)  # and combine_into takes it (CPU, contiguous, fp32 ΔW) where one was built
    undo_mod.combine_into(via, w, d, sign, torch.empty_like(d))
    same_bits_but_nan({"w": bits(via)}, {"w": bits(expect)}, dtype)


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("encoding", ["gaps8", "gaps"])
def test_native_gap_decoding_gives_torchs_positions(monkeypatch, encoding, build):
    """undo.decode_gaps in one native pass against torch's formula (the steps' cumulative sum from -1, a zero
    a filler worth the largest step, with no position): random steps with fillers, leading and trailing
    fillers, all fillers, one entry and none."""
    from loraweave.mechanisms.merge import undo as undo_mod

    dtype, most = undo_mod.GAP_ENCODINGS[encoding]
    if build == "portable":
        lib = native.load(PORTABLE)
        fn = getattr(lib, {"gaps8": "lw_decode_gaps8", "gaps": "lw_decode_gaps16"}[encoding])
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p], ctypes.c_int64
        monkeypatch.setattr(undo_mod, "decoder_for", lambda d, m: fn)
    else:
        assert native.decoder_for(dtype, most) is not None
    g = gen(23)
    steps = torch.randint(0, most + 1, (5000,), generator=g)
    steps[torch.rand(5000, generator=g) < 0.2] = 0  # fillers
    cases = [steps, torch.cat([torch.zeros(3, dtype=torch.long), steps, torch.zeros(2, dtype=torch.long)])]
    cases += [torch.zeros(7, dtype=torch.long), torch.tensor([most]), torch.zeros(0, dtype=torch.long)]
    for case in cases:
        entries = case.to(torch.int32).to(dtype)
        got = undo_mod.decode_gaps(entries, most)
        real = case != 0
        expect = (torch.where(real, case, most).cumsum(0) - 1)[real]  # the formula, written out
        assert got.dtype == torch.int64 and torch.equal(got, expect), (encoding, case[:10])
