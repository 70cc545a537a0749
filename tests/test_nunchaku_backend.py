"""The Nunchaku backend (quant/nunchaku.py) on Nunchaku's real `SVDQW4A4Linear` and `AWQW4A16Linear`, run on
the CPU stand-in for `nunchaku._C` (tests/helpers/nunchaku_cpu.py).

References and bounds:
- packing: the library's fragment layout equals nunchaku's `NunchakuWeightPacker` bit for bit, and a packed
  rank concatenation equals the packer applied to the unpacked concatenation (the seed loader's method);
- plain LoRA (`factor`): the appended tiles hold exactly bf16(A) and bf16(strength·scale·B), the base tiles
  are untouched, the forward makes the same `nunchaku._C` calls as without the LoRA, no hook; the output is
  the base's own output plus the stored factors' term x·(B₁₆A₁₆)ᵀ within
  u·(|base| + |out|) + u·|x·A₁₆ᵀ|·|B₁₆|ᵀ (branch input and output each rounded to bf16 once; u = 2^-8),
  and that term is the fp64 s·x·(BA)ᵀ within the factors' storage rounding 2u·(|x|·|A|ᵀ)·|sB|ᵀ;
- other families (runtime or hosted): output = G·(base's own output − b) + b + exact ΔW term, checked as
  |out − (x·W'ᵀ + b)| ≤ |G|·e_base + 8u·(|x'W'| + |x|·|ΔW|ᵀ), where W' is the fp64 merge of the same file
  into the layer's own dequantized weight W, e_base the base's own int4 bound (helpers' svdq_error_bound),
  G = I (LoRA, LoKr, LoHa), diag(g) (DoRA), the block rotation R (OFT);
- remove(): every parameter object and its bytes, and `rank`, as before.
"""

from __future__ import annotations

import pytest
import torch
from helpers import nunchaku_cpu as nc

import loraweave
from loraweave.quant import backend_for
from loraweave.quant import nunchaku as lib

U = 2.0**-8  # bf16 unit roundoff
LAYERS = {"a": (256, 256), "b": (384, 256)}


def _x(seed: int = 11, k: int = 256) -> torch.Tensor:
    return torch.randn(1, 9, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@torch.no_grad()
def _outputs(model, x) -> dict[str, torch.Tensor]:
    return {n: model.get_submodule(n)(x) for n in ("a", "b", "c")}


def _lora(shapes: dict[str, tuple[int, int]], seed: int, rank: int = 4, alpha: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for name, (out, inp) in shapes.items():
        down, up = torch.randn(rank, inp, generator=g) * 0.3, torch.randn(out, rank, generator=g) * 0.3
        sd |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up}
        sd[f"{name}.alpha"] = torch.tensor(alpha)
        deltas[name] = (down, up, alpha / rank)
    return sd, deltas


def _family(family: str, shapes: dict[str, tuple[int, int]], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, (out, inp) in shapes.items():
        r = 4
        if family == "lokr":
            sd |= {f"{name}.lokr_w1": torch.randn(4, 8, generator=g) * 0.3}
            sd |= {f"{name}.lokr_w2": torch.randn(out // 4, inp // 8, generator=g) * 0.2}
        elif family == "loha":
            for k, shape in {"w1_a": (out, r), "w1_b": (r, inp), "w2_a": (out, r), "w2_b": (r, inp)}.items():
                sd[f"{name}.hada_{k}"] = torch.randn(*shape, generator=g) * 0.5
            sd[f"{name}.alpha"] = torch.tensor(2.0)
        elif family == "dora":
            sd |= {f"{name}.lora_down.weight": torch.randn(r, inp, generator=g) * 0.2}
            sd |= {f"{name}.lora_up.weight": torch.randn(out, r, generator=g) * 0.2}
            sd |= {f"{name}.alpha": torch.tensor(2.0)}
            sd[f"{name}.dora_scale"] = torch.rand(out, 1, generator=g) + 1.5
        elif family == "oft":
            sd[f"{name}.oft_blocks"] = torch.randn(out // 32, 32, 32, generator=g) * 0.1
            sd[f"{name}.alpha"] = torch.tensor(0.0)
        else:
            raise ValueError(family)
    return sd


def _only(sd: dict[str, torch.Tensor], layer: str) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if k.split(".")[0] == layer}


def _float_reference(layer, sd_layer: dict, name: str):
    """(W, W') fp64: the layer's own dequantized weight, and the same adapter merged into it in fp64."""
    w = nc.svdq_weight(layer) if hasattr(layer, "proj_up") else nc.awq_weight(layer)
    root = torch.nn.Module()
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(w)
    root.add_module(name, lin)
    handle = loraweave.apply(root, sd_layer, mode="merge", strict=True)
    merged = lin.weight.detach().clone()
    handle.remove()
    return w, merged


def test_fragment_layout_is_nunchakus_packer():
    packer = nc.packer()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for rank in (16, 48):
            down = torch.randn(rank, 384, generator=g).to(dtype)
            up = torch.randn(256, rank, generator=g).to(dtype)
            assert torch.equal(lib.pack_lowrank(down, down=True), packer.pack_lowrank_weight(down, down=True))
            assert torch.equal(lib.pack_lowrank(up, down=False), packer.pack_lowrank_weight(up, down=False))
            assert torch.equal(lib.unpack_lowrank(lib.pack_lowrank(down, True), True), down)
            assert torch.equal(lib.unpack_lowrank(lib.pack_lowrank(up, False), False), up)
    # appending rank in packed space == the seed loader's unpack, concatenate, repack
    base_down, base_up = torch.randn(32, 384, generator=g).half(), torch.randn(256, 32, generator=g).half()
    new_down, new_up = torch.randn(16, 384, generator=g).half(), torch.randn(256, 16, generator=g).half()
    packed = lib.append_rank(packer.pack_lowrank_weight(base_down, True), new_down.float(), down=True)
    assert torch.equal(packed, packer.pack_lowrank_weight(torch.cat([base_down, new_down]), down=True))
    packed = lib.append_rank(packer.pack_lowrank_weight(base_up, False), new_up.float(), down=False)
    assert torch.equal(packed, packer.pack_lowrank_weight(torch.cat([base_up, new_up], 1), down=False))


def test_owns_and_dequantizes_the_real_classes():
    model = nc.tiny_model()
    assert type(model.a).__name__ == "SVDQW4A4Linear" and type(model.c).__name__ == "AWQW4A16Linear"
    assert backend_for(model.a) is lib.BACKEND and backend_for(model.c) is lib.BACKEND
    assert backend_for(torch.nn.Linear(4, 4)) is None
    assert lib.BACKEND.capabilities(model.a).factor_channel
    assert not lib.BACKEND.capabilities(model.c).factor_channel
    for name in ("a", "b"):
        layer = model.get_submodule(name)
        ours = lib.BACKEND.dequantize(layer).double()
        ref = nc.svdq_weight(layer)
        assert float((ours - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
        assert torch.equal(lib.BACKEND.logical_bias(layer).double(), nc.svdq_parts(layer)["bias"])
    assert torch.allclose(lib.BACKEND.dequantize(model.c).double(), nc.awq_weight(model.c), rtol=0, atol=1e-6)
    assert "nunchaku" not in loraweave.quant.broken()


def test_lora_rides_the_low_rank_branch_exactly():
    model = nc.tiny_model()
    x = _x()
    base = _outputs(model, x)
    before = nc.storage(model)
    sd, deltas = _lora({**LAYERS, "c": (128, 256)}, seed=5)
    calls0 = nc.CALLS.copy()
    _outputs(model, x)
    base_calls = nc.CALLS - calls0

    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    rows = {a.module: a for a in handle.report.applied}
    assert {n: (rows[n].mechanism, rows[n].backend) for n in rows} == {
        "a": ("factor", "nunchaku"),
        "b": ("factor", "nunchaku"),
        "c": ("runtime", "nunchaku"),
    }
    assert rows["a"].rank == 4 and rows["a"].retention == 1.0
    for name in LAYERS:
        layer = model.get_submodule(name)
        down, up, scale = deltas[name]
        packed_down, packed_up = before[f"{name}.proj_down"][0], before[f"{name}.proj_up"][0]
        assert layer.rank == layer.proj_up.shape[1] == 32 + 16  # padded to the kernel's 16-rank tiles
        got_down = nc.unpack_lowrank(layer.proj_down.detach(), down=True)
        got_up = nc.unpack_lowrank(layer.proj_up.detach(), down=False)
        assert torch.equal(got_down[:32], nc.unpack_lowrank(packed_down.detach(), down=True))
        assert torch.equal(got_up[:, :32], nc.unpack_lowrank(packed_up.detach(), down=False))
        assert torch.equal(got_down[32:36], down.to(torch.bfloat16))
        assert torch.equal(got_up[:, 32:36], (up * scale).to(torch.bfloat16))
        assert not got_down[36:].any() and not got_up[:, 36:].any()
        assert not layer._forward_hooks and "forward" not in layer.__dict__
    calls1 = nc.CALLS.copy()
    got = _outputs(model, x)
    assert nc.CALLS - calls1 == base_calls  # the appended rank runs inside the same two kernels
    xd = x.double()
    for name in LAYERS:
        down, up, scale = deltas[name]
        a16, b16 = down.to(torch.bfloat16).double(), (up * scale).to(torch.bfloat16).double()
        stored = (xd @ a16.T) @ b16.T
        bound = (
            U * (base[name].double().abs() + got[name].double().abs()) + U * (xd @ a16.T).abs() @ b16.abs().T
        )
        err = (got[name].double() - base[name].double() - stored).abs()
        assert (err <= bound + 1e-6).all(), (name, float((err / (bound + 1e-6)).max()))
        assert float((stored.abs() > bound + 1e-6).double().mean()) > 0.5  # the bound cannot hide the term
        exact = scale * (xd @ down.double().T) @ up.double().T
        storage_bound = 2.01 * U * (xd.abs() @ down.double().abs().T) @ (scale * up.double()).abs().T
        assert ((stored - exact).abs() <= storage_bound + 1e-9).all()
    handle.remove()
    nc.assert_storage(model, before)
    after = _outputs(model, x)
    assert all(torch.equal(after[n], base[n]) for n in base)


def test_strength_change_rescales_the_appended_rank_in_place():
    model = nc.tiny_model()
    before = nc.storage(model)
    sd, deltas = _lora(LAYERS, seed=6)
    handle = loraweave.apply(model, loraweave.AdapterSpec(sd, name="style"), mode="auto", strict=True)
    installed = {n: (model.get_submodule(n).proj_down, model.get_submodule(n).proj_up) for n in LAYERS}
    for strength in (0.5, -1.25, 0.0, 1.0):
        handle.set_strength("style", strength)
        for name in LAYERS:
            layer = model.get_submodule(name)
            assert (layer.proj_down, layer.proj_up) == installed[name]  # rewritten where it lies
            down, up, scale = deltas[name]
            got_up = nc.unpack_lowrank(layer.proj_up.detach(), down=False)
            assert torch.equal(got_up[:, 32:36], (up * (scale * strength)).to(torch.bfloat16)), strength
            original = before[f"{name}.proj_up"][0].detach()
            assert torch.equal(got_up[:, :32], nc.unpack_lowrank(original, down=False))
    handle.remove()
    nc.assert_storage(model, before)


def _gain(family: str, sd: dict, name: str, w: torch.Tensor, merged: torch.Tensor) -> torch.Tensor:
    """G of W' = G·(W + D): I for additive families, diag(g) for DoRA, the block rotation R for OFT."""
    if family == "oft":
        return merged @ torch.linalg.pinv(w)
    if family == "dora":
        down, up = sd[f"{name}.lora_down.weight"].double(), sd[f"{name}.lora_up.weight"].double()
        plus = w + 0.5 * up @ down  # alpha / rank = 0.5
        return torch.diag((merged * plus).sum(1) / plus.pow(2).sum(1))
    return torch.eye(w.shape[0], dtype=torch.float64)


def _appended(layer, base_rank: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    down = nc.unpack_lowrank(layer.proj_down.detach(), down=True)[base_rank:].double()
    return down, nc.unpack_lowrank(layer.proj_up.detach(), down=False)[:, base_rank:].double()


@pytest.mark.parametrize("family", ["lora", "lokr", "loha", "dora", "oft"])
@pytest.mark.parametrize("route", ["auto", "host"])
def test_every_family_is_the_base_output_plus_its_exact_term(family, route):
    """auto: LoRA rides the branch (factor), the rest run beside the layer (runtime); quantized="host": the
    rest are truncated into the branch (hosted) with the captured energy reported."""
    model = nc.tiny_model()
    x = _x(12)
    base = _outputs(model, x)
    before = nc.storage(model)
    sd = _lora(LAYERS, seed=7)[0] if family == "lora" else _family(family, LAYERS, seed=8)
    refs = {n: _float_reference(model.get_submodule(n), _only(sd, n), n) for n in LAYERS}
    kwargs = {"quantized": "host", "host_rank": 64} if route == "host" else {}
    handle = loraweave.apply(model, sd, mode="auto", strict=True, **kwargs)
    rows = {a.module: a for a in handle.report.applied}
    hosted = route == "host" and family != "lora"
    expected_mechanism = "factor" if family == "lora" else ("hosted" if hosted else "runtime")
    assert {r.mechanism for r in rows.values()} == {expected_mechanism}, handle.report.applied
    assert {r.backend for r in rows.values()} == {"nunchaku"}
    got = _outputs(model, x)
    xd = x.double()
    for name in LAYERS:
        layer = model.get_submodule(name)
        w, merged = refs[name]
        bias = nc.svdq_parts(layer)["bias"]
        plain = base[name].double() - bias  # the base's own output, without its bias
        if hosted:  # the branch carries P = the truncation of ΔW = W' - W: output = base + x·Pᵀ
            down, up = _appended(layer)
            product, delta = up @ down, merged - w
            kept = torch.linalg.svdvals(delta)[: rows[name].rank].pow(2).sum() / delta.pow(2).sum()
            assert abs(rows[name].capture - float(kept)) <= 1e-3, (rows[name].capture, float(kept))
            left = (delta - product).pow(2).sum() / delta.pow(2).sum()
            assert float(left) <= 1 - float(kept) + 2e-3, (float(left), float(kept))
            reference = base[name].double() + xd @ product.T
            path = (xd.abs() @ down.abs().T) @ up.abs().T
            bound = U * (base[name].double().abs() + reference.abs()) + 2 * U * path
        else:  # output = G·(base − b) + b + x·(W' − G·W)ᵀ, the family's exact term on the base's own output
            gain = _gain(family, sd, name, w, merged)
            rest = merged - gain @ w
            reference = plain @ gain.T + bias + xd @ rest.T
            scale = plain.abs() @ gain.abs().T + xd.abs() @ rest.abs().T
            bound = 6 * U * (reference.abs() + scale)
        err = (got[name].double() - reference).abs()
        assert (err <= bound + 1e-6).all(), (family, route, name, float((err / (bound + 1e-6)).max()))
        # the bound cannot hide the term: without it, most outputs would fall outside
        missed = ((reference - base[name].double()).abs() > bound + 1e-6).double().mean()
        assert float(missed) > 0.5, (family, route, name, float(missed))
    handle.remove()
    nc.assert_storage(model, before)
    after = _outputs(model, x)
    assert all(torch.equal(after[n], base[n]) for n in base)


def test_awq_layers_get_runtime_terms():
    model = nc.tiny_model()
    x = _x(13)
    base = _outputs(model, x)
    before = nc.storage(model)
    for family in ("lora", "lokr", "dora"):
        sd = (
            _lora({"c": (128, 256)}, seed=9)[0] if family == "lora" else _family(family, {"c": (128, 256)}, 9)
        )
        handle = loraweave.apply(model, sd, mode="auto", strict=True)
        (row,) = handle.report.applied
        assert (row.module, row.mechanism, row.backend) == ("c", "runtime", "nunchaku")
        w, merged = _float_reference(model.c, sd, "c")
        expected = x.double() @ merged.T + model.c.bias.double()
        got = _outputs(model, x)["c"].double()
        gain = 1.0
        if family == "dora":
            gain = float((merged.norm(dim=1) / w.norm(dim=1)).abs().max()) * 1.5
        bound = U * gain * (base["c"].double() - x.double() @ w.T).abs().max() + 8 * U * expected.abs()
        bound = bound + 4 * U * (x.double().abs() @ (merged - w).abs().T) + 1e-6
        err = (got - expected).abs()
        assert (err <= bound + 2 * U * expected.abs()).all(), (family, float((err / bound).max()))
        handle.remove()
    nc.assert_storage(model, before)
    assert torch.equal(_outputs(model, x)["c"], base["c"])


def test_a_rank_that_disagrees_between_proj_down_and_proj_up_is_refused():
    model = nc.tiny_model()
    layer = model.a
    layer.proj_up = torch.nn.Parameter(torch.cat([layer.proj_up.detach(), layer.proj_up.detach()[:, :16]], 1))
    before = nc.storage(model)
    sd, _ = _lora(LAYERS, seed=10)
    with pytest.raises(loraweave.QuantizedWeightError) as caught:
        loraweave.apply(model, sd, mode="auto", strict=True)
    message = str(caught.value)
    assert "a" in message.split(":")[0] and "proj_down rank 32" in message and "proj_up rank 48" in message
    assert isinstance(caught.value, ValueError)
    nc.assert_storage(model, before)


def test_nvfp4_layers_take_the_branch_but_not_hosting():
    """nvfp4 SVDQW4A4Linear (its forward is not emulated; no forward here): a LoRA is appended exactly; a LoKr
    cannot be hosted (hosting forms ΔW from W, and nvfp4 dequantize is not implemented): auto with
    quantized="host" runs it beside the layer instead, and says why."""
    linear = nc.import_nunchaku("nunchaku.models.linear")
    root = torch.nn.Module()
    root.a = linear.SVDQW4A4Linear(256, 256, rank=32, precision="nvfp4", torch_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        root.a.proj_down.copy_(torch.randn(256, 32, generator=g))
        root.a.proj_up.copy_(torch.randn(256, 32, generator=g))
    before = nc.storage(root)
    sd, deltas = _lora({"a": (256, 256)}, seed=4)
    handle = loraweave.apply(root, sd, mode="auto", strict=True)
    (row,) = handle.report.applied
    assert (row.mechanism, row.backend) == ("factor", "nunchaku")
    down, up, scale = deltas["a"]
    assert torch.equal(_appended(root.a)[0][:4], down.to(torch.bfloat16).double())
    assert torch.equal(_appended(root.a)[1][:, :4], (up * scale).to(torch.bfloat16).double())
    handle.remove()
    nc.assert_storage(root, before)
    lokr = _family("lokr", {"a": (256, 256)}, seed=5)
    handle = loraweave.apply(root, lokr, mode="auto", quantized="host", strict=True)
    (row,) = handle.report.applied
    assert row.mechanism == "runtime" and "nvfp4" in row.why, row
    handle.remove()
    nc.assert_storage(root, before)


def test_a_switch_refills_the_joined_branch_in_place():
    """handle.switch between plain LoRAs: a layer whose padded rank stays the same keeps its joined tensors
    and only the appended tiles are rewritten; a wider rank allocates. Either way the packed pair equals a
    fresh apply of the new set (and nunchaku's packer of the concatenation); removal is bit-exact."""
    model = nc.tiny_model()
    x = _x()
    base = _outputs(model, x)
    before = nc.storage(model)
    packer = nc.packer()
    files = {
        "A": _lora(LAYERS, seed=21)[0],
        "B": _lora(LAYERS, seed=22)[0],
        "C": _lora(LAYERS, seed=23, rank=20)[0],  # bucket 32: two rank tiles instead of one
        "D": _lora({"a": LAYERS["a"]}, seed=24)[0],  # layer b is not written by D
    }
    handle = loraweave.apply(model, loraweave.AdapterSpec(files["A"], name="A"), mode="auto", strict=True)
    joined = {n: (model.get_submodule(n).proj_down, model.get_submodule(n).proj_up) for n in LAYERS}
    steps = [  # (set, {layer: its joined tensors refilled in place}); None: the layer is not written
        ("B", {"a": True, "b": True}),
        ("C", {"a": False, "b": False}),  # wider: allocated
        ("B", {"a": False, "b": False}),  # narrower: allocated
        ("D", {"a": True, "b": None}),
        ("B", {"a": True, "b": False}),  # b's spare was released at the end of the switch to D
    ]
    for name, in_place in steps:
        handle.switch(loraweave.AdapterSpec(files[name], name=name))
        fresh = nc.tiny_model()
        loraweave.apply(fresh, loraweave.AdapterSpec(files[name], name=name), mode="auto", strict=True)
        for layer_name in LAYERS:
            layer, ref = model.get_submodule(layer_name), fresh.get_submodule(layer_name)
            assert layer.rank == ref.rank, (name, layer_name)
            assert torch.equal(layer.proj_down, ref.proj_down) and torch.equal(layer.proj_up, ref.proj_up)
            if in_place[layer_name] is None:  # its original tensors
                assert layer.proj_up is before[f"{layer_name}.proj_up"][0] and layer.rank == 32
                continue
            pair = (layer.proj_down, layer.proj_up)
            same = all(now is was for now, was in zip(pair, joined[layer_name], strict=True))
            assert same == in_place[layer_name], (name, layer_name)
            joined[layer_name] = pair
            down = nc.unpack_lowrank(layer.proj_down.detach(), down=True)
            up = nc.unpack_lowrank(layer.proj_up.detach(), down=False)
            assert torch.equal(layer.proj_down, packer.pack_lowrank_weight(down, down=True))
            assert torch.equal(layer.proj_up, packer.pack_lowrank_weight(up, down=False))
        assert _outputs(model, x).keys() == base.keys()
    handle.remove()
    nc.assert_storage(model, before)
    after = _outputs(model, x)
    assert all(torch.equal(after[n], base[n]) for n in base)
