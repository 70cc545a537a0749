"""Each merge and runtime mechanism on layers at their real size, in every dtype.

Coverage (shapes from the catalog's full-size meta models; each layer materialized alone with seeded values):

| test                          | shapes                                        | dtypes                  |
|-------------------------------|-----------------------------------------------|-------------------------|
| undo kinds auto/compact/copy/ | Flux single proj_out 3072x15360 (47.2M)       | fp32, bf16, fp16, fp8   |
|   source/none                 |                                               |                         |
| strength, switch, remove      | SD1.5 up-block conv 1280x2560x3x3 (29.5M)     | fp32, bf16, fp16, fp8   |
|                               | Wan 14B ffn.0 13824x5120 (70.8M)              | bf16                    |
| fused q|k|v|mlp key (BFL       | Flux to_q/to_k/to_v 3072² + proj_mlp          | bf16                    |
|   single_blocks.N.linear1)    |   12288x3072, one 21504-row LoRA              |                         |
| runtime, per-sample batch     | Flux proj_out; SD1.5 up-block conv            | fp32, bf16, fp16        |

fp8 (float8_e4m3fn storage) has no forward of its own on CPU, so runtime skips it. Merged values: rows every
97th plus the last against W + s·B·A in fp64, to one ulp of the dtype plus the fp32 accumulation bound.
Strength changes and switches: values against fp64, and a return to the first strength gives back the first
merge's bits; `remove()` restores every bit (regenerated from the seed). Runtime: the output minus the layer's
own output equals s·B·A·x (fp64) to 2 ulp of the output, 4 eps of the dtype times the term's largest element
and the fp32 accumulation bound of A·x."""

from __future__ import annotations

import pytest
import torch
from helpers.realsize import (
    Holder,
    RealLayer,
    assert_merged,
    assert_seeded,
    fill_seeded,
    forward64,
    holder,
    layer_input,
    lora_for,
    lora_term64,
    materialized,
    meta_denoiser,
    sample_rows,
    ulp,
)
from safetensors.torch import save_file

import loraweave
from loraweave.mechanisms.merge.undo import bits

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16, FP8]
UNDO = ["auto", "compact", "copy", "source", "none"]
FLUX_PROJ_OUT = RealLayer("flux", "single_transformer_blocks.0.proj_out", (3072, 15360))
WAN_FFN = RealLayer("wan", "blocks.0.ffn.net.0.proj", (13824, 5120))
SD15_CONV = RealLayer("sd1", "up_blocks.0.resnets.0.conv1", (1280, 2560, 3, 3))
# 2 threads on 2 shared cores spin in OpenMP barriers: ~10x a merge's CPU time (and wall time) under load
pytestmark = pytest.mark.usefixtures("one_thread")
SEED = 5


def rel_for(dtype: torch.dtype) -> float:
    """‖ΔW‖/‖W‖: fp8's step is 1/8 of a value (2⁻⁹ below its normals), so its adapter is as large as W for
    most elements to move by more than the tolerance."""
    return 1.0 if dtype == FP8 else 0.05


def test_shapes_are_the_catalogs():
    for layer in (FLUX_PROJ_OUT, WAN_FFN, SD15_CONV):
        assert tuple(meta_denoiser(layer.arch).get_submodule(layer.path).weight.shape) == layer.shape


@pytest.mark.parametrize("undo", UNDO)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_undo_kind_at_real_size(tmp_path, dtype, undo):
    root = holder(FLUX_PROJ_OUT)
    lora = lora_for(FLUX_PROJ_OUT, rel=rel_for(dtype))
    with materialized(root, ["layer"], dtype, SEED):
        weight = root.layer.weight
        rows = sample_rows(FLUX_PROJ_OUT.shape[0])
        original = weight.detach()[rows].clone()
        extra = {}
        if undo == "source":
            extra["undo_source"] = str(tmp_path / "layer.safetensors")
            save_file({k: v.contiguous() for k, v in root.state_dict().items()}, extra["undo_source"])
        handle = loraweave.apply(root, lora.state_dict("layer"), mode="merge", undo=undo, **extra)
        (applied,) = handle.report.applied
        assert applied.undo in ({"compact", "copy"} if undo == "auto" else {undo})
        assert weight.dtype == dtype
        assert_merged(weight, rows, original, lora, 1.0, f"{dtype} undo={undo}")
        handle.remove()
        if undo == "none":  # a permanent fuse: remove() leaves the weights merged
            assert_merged(weight, rows, original, lora, 1.0, "fused after remove()")
        else:
            assert_seeded(weight, SEED, f"{dtype} undo={undo} after remove()")


# Every dtype on the conv; the 70.8M-element Wan FFN in bf16, the dtype Wan 14B runs in.
STRENGTH_CASES = [(dtype, SD15_CONV) for dtype in DTYPES] + [(torch.bfloat16, WAN_FFN)]


@pytest.mark.parametrize(("dtype", "layer"), STRENGTH_CASES, ids=[f"{d}-{la}" for d, la in STRENGTH_CASES])
def test_strength_switch_and_remove_at_real_size(dtype, layer):
    root = holder(layer)
    first, second = lora_for(layer, rel=rel_for(dtype), seed=1), lora_for(layer, rel=rel_for(dtype), seed=2)
    with materialized(root, ["layer"], dtype, SEED):
        weight = root.layer.weight
        rows = sample_rows(layer.shape[0])
        original = weight.detach()[rows].clone()
        spec = loraweave.AdapterSpec(first.state_dict("layer"), name="first")
        handle = loraweave.apply(root, spec, mode="merge")
        merged_bits = bits(weight.detach()).clone()
        assert_merged(weight, rows, original, first, 1.0, "first at 1.0")
        handle.set_strength("first", -1.0)
        assert_merged(weight, rows, original, first, -1.0, "first at -1.0")
        handle.set_strength("first", 1.0)
        assert torch.equal(bits(weight.detach()), merged_bits), "back at 1.0: not the first merge's bits"
        del merged_bits
        handle.switch([loraweave.AdapterSpec(second.state_dict("layer"), strength=1.5, name="second")])
        assert_merged(weight, rows, original, second, 1.5, "switched to second at 1.5")
        handle.remove()
        assert_seeded(weight, SEED, f"{layer} {dtype} after switch and remove()")


def test_fused_qkv_mlp_key_lands_on_its_row_chunks_at_real_size():
    """A BFL-named LoRA on single_blocks.0.linear1 (q|k|v|mlp, 21504 rows) merges into the 4 diffusers
    layers."""
    model = meta_denoiser("flux").to(torch.bfloat16)
    block = "single_transformer_blocks.0"
    chunks = [("attn.to_q", 3072), ("attn.to_k", 3072), ("attn.to_v", 3072), ("proj_mlp", 12288)]
    fused = lora_for(RealLayer("flux", "linear1", (21504, 3072)), seed=3)
    sd = {
        "lora_unet_single_blocks_0_linear1.lora_down.weight": fused.a,
        "lora_unet_single_blocks_0_linear1.lora_up.weight": fused.b,
    }
    paths = [f"{block}.{name}" for name, _ in chunks]
    with materialized(model, paths, torch.bfloat16, SEED):
        weights = [model.get_submodule(p).weight for p in paths]
        samples = [sample_rows(n) for _, n in chunks]
        originals = [w.detach()[r].clone() for w, r in zip(weights, samples, strict=True)]
        handle = loraweave.apply(model, sd, mode="merge", strict=True)
        assert sorted(m.module for m in handle.report.applied) == sorted(paths)
        start = 0
        for (name, n), w, r, original in zip(chunks, weights, samples, originals, strict=True):
            part = type(fused)(fused.a, fused.b[start : start + n])
            assert_merged(w, r, original, part, 1.0, f"{name} (fused rows {start}:{start + n})")
            start += n
        handle.remove()
        for i, (p, w) in enumerate(zip(paths, weights, strict=True)):
            assert_seeded(w, SEED + i, f"{p} after remove()")


def assert_term(got, base, term, absolute, dtype, what) -> None:
    """got − base = term (fp64) to 2 ulp of the output, plus 4 eps(dtype) of the largest |term| (the term's
    own roundings), plus `absolute` (√fan_in·2⁻²⁴·|s|·|B|·|A|·|x|: the fp32 accumulation of A·x); and the term
    is larger than that tolerance on most elements (the check could fail)."""
    tol = 2 * ulp(base.double() + term, dtype) + 4 * torch.finfo(dtype).eps * term.abs().max() + absolute
    err = (got.double() - base.double() - term).abs()
    assert bool((err <= tol).all()), f"{what}: worst |err| - tol = {float((err - tol).max()):.3g}"
    assert float((term.abs() > tol).double().mean()) > 0.5, f"{what}: the term is below the tolerance"


@pytest.mark.parametrize("layer", [FLUX_PROJ_OUT, SD15_CONV], ids=str)
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=str)
def test_runtime_and_per_sample_batch_at_real_size(dtype, layer):
    root: Holder = holder(layer)
    a, b = lora_for(layer, seed=1), lora_for(layer, seed=2)
    x = layer_input(layer, dtype, seed=4)
    with materialized(root, ["layer"], dtype, SEED), torch.no_grad():
        base = root(x)
        assert (base.double() - forward64(layer, x, root.layer.weight, root.layer.bias)).abs().max() < 0.1
        specs = [
            loraweave.AdapterSpec(a.state_dict("layer"), strength=0.8, name="a"),
            loraweave.AdapterSpec(b.state_dict("layer"), strength=-1.2, name="b"),
        ]
        handle = loraweave.apply(root, specs, mode="runtime")
        assert {m.mechanism for m in handle.report.applied} == {"runtime"}
        term_a, term_b = 0.8 * lora_term64(layer, x, a), -1.2 * lora_term64(layer, x, b)
        accumulation = layer.fan_in**0.5 * 2.0**-24
        abs_a = accumulation * 0.8 * lora_term64(layer, x, a, absolute=True)
        abs_b = accumulation * 1.2 * lora_term64(layer, x, b, absolute=True)
        assert_term(root(x), base, term_a + term_b, abs_a + abs_b, dtype, "runtime a+b")
        with handle.batch([["a"], ["b"]]):
            got = root(x)
        assert_term(got[:1], base[:1], term_a[:1], abs_a[:1], dtype, "sample 0: a only")
        assert_term(got[1:], base[1:], term_b[1:], abs_b[1:], dtype, "sample 1: b only")
        handle.set_strength("a", 0.0)
        assert_term(root(x), base, term_b, abs_b, dtype, "a at 0")
        handle.remove()
        assert torch.equal(root(x), base)
        assert_seeded(root.layer.weight, SEED, "runtime leaves the weight untouched")


@pytest.mark.parametrize("undo", ["auto", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_blocks_shared_by_threads_write_one_threads_bits_at_real_size(dtype, undo):
    """The fused pass (undo="auto"), the direct write (undo="none") and the record's rebuild (remove) with
    their blocks shared by 3 threads (mechanisms/merge/blocks.py, direct.py, undo.py) write the bits and keep
    the record of one thread, at full size."""
    root = holder(FLUX_PROJ_OUT)
    lora = lora_for(FLUX_PROJ_OUT, rel=rel_for(dtype))
    with materialized(root, ["layer"], dtype, SEED):
        weight = root.layer.weight
        outcomes = []
        for threads in (1, 3):
            torch.set_num_threads(threads)
            try:
                handle = loraweave.apply(root, lora.state_dict("layer"), mode="merge", undo=undo)
            finally:
                torch.set_num_threads(1)
            merge = root.layer._loraweave_merges[-1]  # (a permanent fuse stays listed)
            record = merge.record
            fields = (
                [getattr(record, f) for f in ("positions", "values", "guard_pos")] if undo == "auto" else []
            )
            outcomes.append(
                (bits(weight.detach()).clone(), [f.clone() for f in fields], handle.report.applied[0])
            )
            if undo == "none":
                with torch.no_grad():  # a permanent fuse: the seeded weight back for the next thread count
                    fill_seeded(weight, SEED)
            else:
                torch.set_num_threads(threads)
                try:
                    handle.remove()  # at 3 threads the record's rebuild is shared too
                finally:
                    torch.set_num_threads(1)
                assert_seeded(weight, SEED, f"{dtype} after remove() at {threads} threads")
        (one, one_fields, one_row), (three, three_fields, three_row) = outcomes
        assert torch.equal(one, three), f"{dtype} undo={undo}: 3 threads wrote other bits"
        assert one_row.undo == three_row.undo and one_row.undo_bytes == three_row.undo_bytes
        assert all(torch.equal(a, b) for a, b in zip(one_fields, three_fields, strict=True))
