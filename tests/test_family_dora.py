"""DoRA (dora_scale / lora_magnitude_vector) over LoRA, LoHa, LoKr: merge and runtime against the producers.

References: LyCORIS 4.x's own wrapped forward (`dora_wd=True`, both `wd_on_output` axes) for `dora_scale`
files, PEFT (`use_dora=True`) for `lora_magnitude_vector` files, and an independent fp64 formula.
Tolerances (rel. error = max|ours - ref| / max|ref|, fp32): <= 1e-5 on layer outputs and on the adapter's
share of them; merged weights against fp64 formulas <= 1e-6.
"""

from __future__ import annotations

import copy

import lycoris  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
import torch
import torch.nn.functional as F
from helpers.common import gen, multiplier_outputs, outputs, randn_inputs, rel_err, save_lycoris
from helpers.family_models import dora_sd
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from torch import nn

import loraweave
from loraweave.families import FAMILIES
from loraweave.families.base import PartRejected

TOL = 1e-5
MULTIPLIERS = (1.0, 0.5, -1.0)
LAYERS = ("lin", "conv")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(64, 128)  # large enough for LoKr to factor w2 at rank 4
        self.conv = nn.Conv2d(8, 12, 3, padding=1)


def inputs() -> dict[str, torch.Tensor]:
    return randn_inputs({"lin": (2, 3, 64), "conv": (2, 8, 6, 5)})


def check_modes(tmp_path, pristine, source, refs, base, xs, strengths):
    """Apply `source` by merge and runtime at each strength; compare every layer with refs[strength]."""
    for s in strengths:
        got = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = loraweave.apply(model, source, mode=mode, strength=s)
            report = handle.report
            assert report.unmatched == [], [(u["key"], u["reason"]) for u in report.unmatched]
            assert report.keys_applied == report.keys_total
            got[mode] = outputs(model, xs)
            for name in LAYERS:
                ref, ours = refs[s][name], got[mode][name]
                assert rel_err(ref, base[name]) > 0.05, f"{name}: adapter has no visible effect"
                assert rel_err(ours, ref) <= TOL, (mode, s, name, rel_err(ours, ref))
                assert rel_err(ours - base[name], ref - base[name]) <= TOL, (mode, s, name)
            assert (not torch.equal(model.lin.weight, pristine.lin.weight)) == (mode == "merge")
            handle.remove()
            for name, out in outputs(model, xs).items():
                assert torch.equal(out, base[name]), f"{mode}: remove() did not restore {name}"
    for mode in ("merge", "runtime"):  # live strength changes: the runtime gain cache is keyed by strength
        model = copy.deepcopy(pristine)
        handle = loraweave.apply(model, source, mode=mode, strength=strengths[0])
        (adapter,) = handle.strengths
        for s in (*strengths[1:], strengths[0]):
            handle.set_strength(adapter, s)
            for name, out in outputs(model, xs).items():
                assert rel_err(out, refs[s][name]) <= TOL, (mode, "set_strength", s, name)


# (algo, wd_on_output, use_tucker): Tucker puts the conv kernel in lora_mid / hada_t1,t2 / lokr_t2.
CASES = [(a, o, False) for a in ("lora", "loha", "lokr") for o in (True, False)] + [
    (a, True, True) for a in ("lora", "loha", "lokr")
]


@pytest.mark.parametrize(
    "algo, on_out, tucker",
    CASES,
    ids=[f"{a}-{'out' if o else 'in'}{'-tucker' if t else ''}" for a, o, t in CASES],
)
def test_matches_lycoris_wrapped_forward(tmp_path, lycoris_class_attrs, algo, on_out, tucker):
    pristine = Net()
    xs = inputs()
    base = outputs(pristine, xs)
    wrapped = copy.deepcopy(pristine)
    # Tucker: conv rank 1, so LoKr factors its w2 too. alpha != rank everywhere.
    conv = {"conv_dim": 1, "conv_alpha": 0.75} if tucker else {"conv_dim": 2, "conv_alpha": 1.5}
    net = lycoris.create_lycoris(
        wrapped,
        1.0,
        linear_dim=4,
        linear_alpha=3.0,
        **conv,
        algo=algo,
        dora_wd=True,
        wd_on_output=on_out,
        use_tucker=tucker,
    )
    assert sorted(m.lora_name for m in net.loras) == ["lycoris_conv", "lycoris_lin"]
    assert all(m.wd and m.wd_on_out == on_out for m in net.loras)
    net.apply_to()
    g = gen(2)
    with torch.no_grad():  # zero-init factors and d = ‖W‖ would hide errors: perturb everything
        for m in net.loras:
            for name, p in m.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                p.copy_(p * (1 + 0.2 * noise) if name == "dora_scale" else noise * 0.3)
    refs = multiplier_outputs(net, wrapped, xs, MULTIPLIERS)
    path = tmp_path / "dora.safetensors"
    saved = save_lycoris(net, path)
    if tucker:
        assert {"lycoris_conv.lora_mid.weight", "lycoris_conv.hada_t1", "lycoris_conv.lokr_t2"} & set(saved)
    scale_shapes = {k: tuple(v.shape) for k, v in saved.items() if k.endswith(".dora_scale")}
    want = {"lin": (128, 1) if on_out else (1, 64), "conv": (12, 1, 1, 1) if on_out else (1, 8, 1, 1)}
    assert scale_shapes == {f"lycoris_{n}.dora_scale": s for n, s in want.items()}
    check_modes(tmp_path, pristine, str(path), refs, base, xs, MULTIPLIERS)


class PeftNet(Net):
    def forward(self, x):
        return x


def test_matches_peft_dora(tmp_path):
    """A PEFT `use_dora=True` file (saved by PEFT, alpha in adapter_config.json): weights merged by PEFT
    vs ours at strength 1, and PEFT's forward with `set_scale` (strength inside the norm) at 1, 0.5, -1."""
    pristine = PeftNet()
    xs = inputs()
    base = outputs(pristine, xs)
    peft_model = get_peft_model(
        copy.deepcopy(pristine), LoraConfig(r=4, lora_alpha=3, target_modules=list(LAYERS), use_dora=True)
    )
    g = gen(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    saved = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert {k: tuple(v.shape) for k, v in saved.items() if "magnitude" in k} == {
        "base_model.model.lin.lora_magnitude_vector": (128,),
        "base_model.model.conv.lora_magnitude_vector": (1, 12, 1, 1),
    }
    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    refs = {}
    for s in MULTIPLIERS:
        for m in layers:
            m.set_scale("default", s)
        refs[s] = {n: peft_model.base_model.model.get_submodule(n)(x).detach() for n, x in xs.items()}
    for m in layers:
        m.set_scale("default", 1.0)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    ours = copy.deepcopy(pristine)
    loraweave.apply(ours, str(tmp_path / "peft"), mode="merge", strict=True)
    for name in LAYERS:
        assert rel_err(ours.get_submodule(name).weight, merged.get_submodule(name).weight) <= 1e-6, name
    check_modes(tmp_path, pristine, str(tmp_path / "peft"), refs, base, xs, MULTIPLIERS)


@pytest.mark.parametrize("on_out", (True, False), ids=("out_axis", "in_axis"))
def test_norm_of_original_plus_delta_on_the_right_axis(on_out, monkeypatch):
    """ComfyUI normalises the output axis by ‖W‖, not ‖W + γΔW‖; we take the norm of W_c on the right axis
    of the ORIGINAL weight: at strength 1 every merged row (column) has norm exactly dora_scale."""
    pristine = nn.ModuleDict({"lin": nn.Linear(24, 32)})
    sd = dora_sd(on_out)
    w = pristine.lin.weight.double()
    wc = w + 0.5 * sd["lin.lora_up.weight"].double() @ sd["lin.lora_down.weight"].double()  # γ = 2/4
    d = sd["lin.dora_scale"].double()
    axis = 1 if on_out else 0
    for s in (1.0, 0.5):
        model = copy.deepcopy(pristine)
        handle = loraweave.apply(model, (sd, s), mode="merge", strict=True)
        merged = model.lin.weight.double()
        ref = wc * (s * (d / wc.norm(dim=axis, keepdim=True) - 1) + 1)
        assert rel_err(merged, ref) <= 1e-6, s
        if s == 1.0:
            assert torch.allclose(merged.norm(dim=axis, keepdim=True), d, rtol=1e-6)
            comfy = wc * d / w.norm(dim=axis, keepdim=True)  # the defect: ‖W‖, not ‖W + γΔW‖
            assert rel_err(comfy, ref) > 1e-2
        handle.remove()
        monkeypatch.setattr(
            loraweave.families.dora, "BLOCK", 5 * 24
        )  # runtime gain over W_c in blocks of 5 rows
        handle = loraweave.apply(model, (sd, s), mode="runtime", strict=True)
        x = torch.randn(7, 24, generator=gen(8))
        with torch.no_grad():
            assert rel_err(model.lin(x), F.linear(x.double(), ref, model.lin.bias.double())) <= TOL, s
        handle.remove()
    # Stacked with a plain LoRA on the same layer: DoRA still reads the original W, order-free.
    other = {
        "lin.lora_down.weight": torch.randn(2, 24, generator=gen(9)),
        "lin.lora_up.weight": torch.randn(32, 2, generator=gen(10)),
    }
    for adapters in ([(sd, 1.0), (other, 1.0)], [(other, 1.0), (sd, 1.0)]):
        model = copy.deepcopy(pristine)
        loraweave.apply(model, adapters, mode="merge", strict=True)
        ref = (
            wc * d / wc.norm(dim=axis, keepdim=True)
            + other["lin.lora_up.weight"].double() @ other["lin.lora_down.weight"].double()
        )
        assert rel_err(model.lin.weight, ref) <= 1e-6


def test_fused_flux_qkv_split_over_modules():
    """kohya Flux `img_attn.qkv` (96 rows) lands on to_q/to_k/to_v: the output axis is row-local (exact per
    module, merge and runtime), the input axis needs all 96 rows at once and is refused with a reason."""
    from helpers.tiny_models import flux_forward, tiny_flux

    pristine = tiny_flux()
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    g = gen(5)
    down, up = torch.randn(4, 32, generator=g) * 0.3, torch.randn(96, 4, generator=g) * 0.3
    sd = {
        f"{stem}.lora_down.weight": down,
        f"{stem}.lora_up.weight": up,
        f"{stem}.alpha": torch.tensor(2.0),
        f"{stem}.dora_scale": torch.rand(96, 1, generator=g) + 0.5,
    }
    attn = "transformer_blocks.0.attn"
    names = [f"{attn}.to_q", f"{attn}.to_k", f"{attn}.to_v"]
    w = torch.cat([pristine.get_submodule(n).weight.double() for n in names])
    wc = w + 0.5 * up.double() @ down.double()
    s = 0.7
    ref = wc * (s * (sd[f"{stem}.dora_scale"].double() / wc.norm(dim=1, keepdim=True) - 1) + 1)
    x = torch.randn(3, 32, generator=gen(6))
    outs = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(pristine)
        handle = loraweave.apply(model, (sd, s), mode=mode, strict=True)
        assert handle.report.keys_applied == len(sd)
        for i, name in enumerate(names):
            module, rows = model.get_submodule(name), ref[32 * i : 32 * (i + 1)]
            if mode == "merge":
                assert rel_err(module.weight, rows) <= 1e-6, name
            with torch.no_grad():
                ref_out = F.linear(x.double(), rows, module.bias.double())
                assert rel_err(module(x), ref_out) <= TOL, (mode, name)
        with torch.no_grad():
            outs[mode] = flux_forward(model)
    assert rel_err(outs["runtime"], outs["merge"]) <= TOL
    sd[f"{stem}.dora_scale"] = torch.rand(1, 32, generator=g) + 0.5
    report = loraweave.plan(pristine, sd)
    assert len(report.unmatched) == len(sd)
    assert all("not row-local" in u["reason"] for u in report.unmatched), report.unmatched


def test_load_validation():
    load = FAMILIES["dora"].load

    def check(f, shape):
        return FAMILIES["dora"].fit(f, shape)[1]

    def factors(**tensors):
        return load(tensors, {k: f"m.{k}" for k in tensors})

    lora_t = {"down": torch.randn(4, 24), "up": torch.randn(32, 4)}
    f = factors(**lora_t, dora_scale=torch.ones(32, 1))
    assert (f.kind, f.on_out, f.rank, f.rows, f.is_conv_kernel) == ("lora", True, 4, 32, False)
    assert check(f, (32, 24)) is None
    f = factors(**lora_t, dora_scale=torch.ones(1, 24))
    assert not f.on_out and check(f, (32, 24)) is None and check(f, (32, 25)).kind == "shape_mismatch"
    f = factors(
        hada_w1_a=torch.randn(12, 2),
        hada_w1_b=torch.randn(2, 72),
        hada_w2_a=torch.randn(12, 2),
        hada_w2_b=torch.randn(2, 72),
        dora_scale=torch.ones(12, 1, 1, 1),
    )
    f, miss = FAMILIES["dora"].fit(f, (12, 8, 3, 3))
    assert f.kind == "loha" and miss is None and f.is_conv_kernel
    peft_keys = {"down": "a", "up": "b", "dora_scale": "m.lora_magnitude_vector"}
    f = load({**lora_t, "dora_scale": torch.ones(1, 32, 1, 1)}, peft_keys)
    assert f.peft and f.on_out
    bad = {
        "shape mismatch": [
            dict(**lora_t, dora_scale=torch.ones(31, 1)),
            dict(**lora_t, dora_scale=torch.ones(24)),
            dict(**lora_t, dora_scale=torch.ones(2, 24)),
        ],
        "incomplete DoRA": [
            dict(dora_scale=torch.ones(32, 1)),
            dict(**lora_t, lokr_w1=torch.ones(4, 4), dora_scale=torch.ones(32, 1)),
        ],
        "bad tensor": [dict(**lora_t, dora_scale=torch.full((32, 1), float("nan")))],
        "unsupported family": [dict(**lora_t, up_bias=torch.ones(32), dora_scale=torch.ones(32, 1))],
    }
    for reason, cases in bad.items():
        for case in cases:
            with pytest.raises(PartRejected, match=reason):
                factors(**case)
