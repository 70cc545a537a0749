"""Per-sample adapter sets (Handle.batch): one forward over 4 samples, each with its own set, equals the 4
separate runtime runs, on tiny Flux, SDXL-UNet, Z-Image and Wan (fp32, rel 1e-5), with and without guidance
duplication (`cat([uncond, cond])`), with LoRA, LoKr, LoHa and DoRA, on fused q/k/v and on an SDNQ-quantized
model; the row mapping also on the rest of the support matrix.

References are independent applies: each sample's set alone on a fresh copy of the model (the empty set: the
untouched model), its inputs alone."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers.batch_inputs import ARCHS, MORE, batch_inputs, cat, run, take
from helpers.common import rel_err
from helpers.persample_adapters import adapter

import loraweave
from loraweave.errors import BatchError
from loraweave.mechanisms.sampling import mix

TOL = 1e-5
SETS = [["a"], ["b", "c"], [], ["a", "d"]]
STRENGTHS = [[0.7], [1.0, -0.5], [], [1.2, 0.4]]
FAMILY = {"a": "lora", "b": "lokr", "c": "loha", "d": "dora"}  # DoRA: a term that reads the base output


def adapters(model, families: dict[str, str] = FAMILY) -> dict[str, dict]:
    return {name: adapter(model, fam, seed) for seed, (name, fam) in enumerate(families.items(), start=1)}


def separate(arch: str, base, ads: dict, inputs: dict, pairs: bool = False) -> list[torch.Tensor]:
    """Each sample alone (with `pairs`, rows i and 4 + i), with its set alone, applied at runtime to a fresh
    copy."""
    refs = []
    for i, (names, values) in enumerate(zip(SETS, STRENGTHS, strict=True)):
        model = copy.deepcopy(base)
        specs = [
            loraweave.AdapterSpec(ads[n], strength=v, name=n) for n, v in zip(names, values, strict=True)
        ]
        handle = loraweave.apply(model, specs, mode="runtime") if specs else None
        refs.append(run(arch, model, take(inputs, [i, 4 + i] if pairs else [i])))
        if handle is not None:
            handle.remove()
    return refs


def check(got: torch.Tensor, refs: list[torch.Tensor], rows_of) -> None:
    for i, ref in enumerate(refs):
        assert rel_err(got[rows_of(i)], ref) <= TOL, (i, rel_err(got[rows_of(i)], ref))
    # negative control: a sample's rows against another sample's reference are far off
    assert all(rel_err(got[rows_of(i)], refs[(i + 1) % len(refs)]) > 1e-2 for i in range(len(refs)))


def applied(base, ads):
    model = copy.deepcopy(base)
    specs = [loraweave.AdapterSpec(sd, name=n) for n, sd in ads.items()]
    return model, loraweave.apply(model, specs, mode="runtime", strict=True)


@pytest.mark.parametrize("arch", sorted(ARCHS) + sorted(MORE))
def test_batch_equals_separate_runs(arch, monkeypatch):
    """The 4 acceptance models with LoRA, LoKr and LoHa; the rest of the support matrix (the row mapping) with
    LoRA."""
    base = (ARCHS.get(arch) or MORE[arch])()
    ads = adapters(base, FAMILY if arch in ARCHS else dict.fromkeys(FAMILY, "lora"))
    pos, neg = batch_inputs(arch, 4, seed=1), batch_inputs(arch, 4, seed=2)
    model, handle = applied(base, ads)
    plain = run(arch, model, pos)
    refs = separate(arch, base, ads, cat(neg, pos), pairs=True)  # sample i alone: its [uncond, cond] rows
    # both formulations: short runs gate the whole pair per row (the default on these tiny models), long runs
    # compute each set's own ranks on its rows (forced here with a threshold of 0)
    for limit in (mix.GATED_MAX_TOKEN_RANKS, 0):
        monkeypatch.setattr(mix, "GATED_MAX_TOKEN_RANKS", limit)
        with handle.batch(SETS, STRENGTHS):
            got = run(arch, model, pos)
            got_cfg = run(arch, model, cat(neg, pos))  # 8 rows: sample i at rows i and 4 + i
        check(got, [r[1:] for r in refs], lambda i: slice(i, i + 1))
        check(got_cfg, refs, lambda i: [i, 4 + i])
    assert all(rp.mix is None for rp in handle.runtime_paths)  # the block closed: plain runtime again
    assert torch.equal(run(arch, model, pos), plain)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_exact_batch_is_a_lone_apply_at_the_batch_shape(arch):
    """exact=True, LoRA sets: sample i's rows are bit-equal (torch.equal) to a runtime apply of its set alone
    on a fresh copy, run on the same whole batch (guidance layout), whatever the other samples use. Negative
    control: a lone apply of a two-adapter set in the other order is not bit-equal. Measured, not asserted:
    with a W-reading adapter (DoRA) resident on a layer, that layer runs as a hook, not fused, so a LoRA-only
    sample there is not bit-equal to its lone (fused) apply."""
    base = ARCHS[arch]()
    ads = adapters(base, dict.fromkeys(FAMILY, "lora"))
    x = cat(
        batch_inputs(arch, 4, seed=2), batch_inputs(arch, 4, seed=1)
    )  # 8 rows: sample i at rows i and 4 + i
    model, handle = applied(base, ads)
    refs = []
    for names, values in zip(SETS, STRENGTHS, strict=True):
        lone = copy.deepcopy(base)
        if names:
            loraweave.apply(
                lone,
                [
                    loraweave.AdapterSpec(ads[n], strength=v, name=n)
                    for n, v in zip(names, values, strict=True)
                ],
                mode="runtime",
            )
        refs.append(run(arch, lone, x))
    with handle.batch(SETS, STRENGTHS, exact=True):
        got = run(arch, model, x)
    assert all(torch.equal(got[[i, 4 + i]], refs[i][[i, 4 + i]]) for i in range(4))
    # Negative control: the same set applied alone in the other order rounds differently, so torch.equal here
    # sees a change of term order (the thing `exact` keeps), not just a wrong delta.
    i, names, values = next(
        (i, n, v) for i, (n, v) in enumerate(zip(SETS, STRENGTHS, strict=True)) if len(n) > 1
    )
    flipped = copy.deepcopy(base)
    loraweave.apply(
        flipped,
        [
            loraweave.AdapterSpec(ads[n], strength=v, name=n)
            for n, v in reversed(list(zip(names, values, strict=True)))
        ],
        mode="runtime",
    )
    assert not torch.equal(got[[i, 4 + i]], run(arch, flipped, x)[[i, 4 + i]])
    with handle.batch(
        SETS, STRENGTHS
    ):  # the default forms: within float tolerance (bit-equal on some models)
        default = run(arch, model, x)
    check(default, [r[[i, 4 + i]] for i, r in enumerate(refs)], lambda i: [i, 4 + i])


def test_batch_on_fused_qkv():
    """Separate to_q/to_k/to_v keys landing on row ranges of fuse_qkv_projections()' to_qkv."""
    base = ARCHS["flux"]()
    ads = {n: adapter(base, "lora", seed) for seed, n in enumerate("abcd", start=1)}
    fused = copy.deepcopy(base)
    fused.fuse_qkv_projections()
    assert any(n.endswith("to_qkv") for n, _ in fused.named_modules())
    x = batch_inputs("flux", 4)
    model, handle = applied(fused, ads)
    assert any(
        rp.module is m
        for rp in handle.runtime_paths
        for n, m in model.named_modules()
        if n.endswith("to_qkv")
    )
    with handle.batch(SETS, STRENGTHS):
        got = run("flux", model, x)
    check(got, separate("flux", fused, ads, x), lambda i: slice(i, i + 1))


def test_batch_on_sdnq_quantized():
    os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
    from sdnq import sdnq_post_load_quant

    base = ARCHS["flux"]()
    with torch.random.fork_rng():
        torch.manual_seed(1)
        sdnq_post_load_quant(
            base,
            add_skip_keys=False,
            weights_dtype="int8",
            minimum_allowed_numel=0,
            minimum_allowed_channel_size=0,
        )
    assert {type(m).__name__ for m in base.modules() if "Linear" in type(m).__name__} == {"SDNQLinear"}
    ads = adapters(ARCHS["flux"]())  # keys from the float model: same paths
    x = batch_inputs("flux", 4)
    model, handle = applied(base, ads)
    assert handle.report.counts()["transformer"] == {"runtime": len(handle.report.applied)}
    with handle.batch(SETS, STRENGTHS):
        got = run("flux", model, x)
    check(got, separate("flux", base, ads, x), lambda i: slice(i, i + 1))


def test_batch_refusals_leave_the_handle_as_it_was():
    base = ARCHS["zimage"]()
    ads = adapters(base)
    model, handle = applied(base, ads)
    x = batch_inputs("zimage", 2)
    plain = run("zimage", model, x)
    bad = [
        ([["a"], ["nope"]], None, "no adapter named 'nope'"),
        ([["a"], "b"], None, "list of adapter names"),
        ([["a", "a"], []], None, "named twice"),
        ([["a"], ["b"]], [[1.0], [float("nan")]], "finite"),
        ([["a"], ["b"]], [[1.0]], "one entry per sample"),
        ([["a"], ["b"]], [[1.0], {"c": 1.0}], "does not use"),
        ([], None, "non-empty"),
    ]
    for sets, strengths, message in bad:
        with pytest.raises(BatchError, match=message), handle.batch(sets, strengths):
            pass
    for exact in ("false", 1, None):  # a truthy string must not pick the exact form
        with (
            pytest.raises(BatchError, match=r"exact=\.\.\.\) must be True or False"),
            handle.batch([["a"], ["b"]], exact=exact),
        ):
            pass
    # rows that cannot be mapped: 3 model rows for 2 samples; samples of unequal size packed into one axis
    with pytest.raises(BatchError, match="not a multiple"), handle.batch([["a"], ["b"]]):
        run("zimage", model, batch_inputs("zimage", 3))
    uneven = {**x, "x": [x["x"][0], torch.randn(4, 1, 8, 16)]}
    with pytest.raises(BatchError, match="cannot be known"), handle.batch([["a"], ["b"]]):
        run("zimage", model, uneven)
    layer = next(rp.module for rp in handle.runtime_paths if isinstance(rp.module, torch.nn.Linear))
    with pytest.raises(BatchError, match="outside its model's forward"), handle.batch([["a"], ["b"]]):
        layer(torch.randn(2, layer.in_features))
    assert all(rp.mix is None for rp in handle.runtime_paths) and handle.mix is None
    assert not any(root._forward_pre_hooks for _, root in handle.components)
    assert torch.equal(run("zimage", model, x), plain)


def test_batch_refuses_merged_adapters():
    base = ARCHS["flux"]()
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, [loraweave.AdapterSpec(adapter(base, "lora", 1), name="a")], mode="merge")
    with pytest.raises(BatchError, match="merged into"), handle.batch([["a"], []]):
        pass
    handle.remove()
