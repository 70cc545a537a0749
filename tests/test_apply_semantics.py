"""What apply computes: merged weights and runtime outputs against independent fp64 references.

Tolerances (rel. error = max|ours - ref| / max|ref|):
- fp32 merged weights: <= 1e-6 against W + s*(alpha/r)*up@down computed in fp64 and rounded to fp32.
- fp64 merged weights: <= 1e-12 (a merge must not drop a float64 weight to fp32 precision).
- fp16/bf16 merged weights: equal to (W.double() + delta).to(dtype) element for element, except at most
  max(1, 0.1%) of the elements, and each of those within one ulp of the correctly rounded value (the merge
  accumulates in fp32 and rounds once, so fp64 -> fp32 -> fp16 double rounding may move a value by one ulp).
- runtime outputs (fp32): <= 1e-5 against an fp64 forward of the reference weight; runtime set_strength
  against a fresh apply at that strength: <= 1e-6.
- merge set_strength against a fresh merge at that strength: bit-exact (torch.equal).
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.common import gen, rel_err
from safetensors.torch import save_file
from torch import nn

import loraweave

MERGE_TOL = 1e-6
RUNTIME_TOL = 1e-5


def container(**modules: nn.Module) -> nn.Module:
    root = nn.Module()
    for name, module in modules.items():
        setattr(root, name, module)
    return root


def linear(inp: int, out: int, seed: int, dtype=torch.float32, bias: bool = True) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(inp, out, bias=bias).to(dtype)
    with (
        torch.no_grad()
    ):  # drawn in fp64 and rounded once into the layer's dtype (fp64 layers hold full values)
        layer.weight.copy_(torch.randn(out, inp, generator=gen(seed), dtype=torch.float64) * 0.5)
        if bias:
            layer.bias.copy_(torch.randn(out, generator=gen(seed + 10_000), dtype=torch.float64) * 0.1)
    return layer


def lora_sd(
    name: str,
    out: int,
    inp: int,
    rank: int,
    seed: int,
    alpha: float | None = None,
    dtype=torch.float32,
    peft: bool = False,
    kernel: int | None = None,
) -> dict[str, torch.Tensor]:
    g = gen(seed)
    if kernel is None:
        down = torch.randn(rank, inp, generator=g)
        up = torch.randn(out, rank, generator=g)
    else:
        down = torch.randn(rank, inp, kernel, kernel, generator=g)
        up = torch.randn(out, rank, 1, 1, generator=g)
    d, u = ("lora_A.weight", "lora_B.weight") if peft else ("lora_down.weight", "lora_up.weight")
    sd = {f"{name}.{d}": down.to(dtype), f"{name}.{u}": up.to(dtype)}
    if alpha is not None:
        sd[f"{name}.alpha"] = torch.tensor(float(alpha))
    return sd


def delta_of(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """fp64 up @ down (with a Tucker core when present), shaped like the module weight; no scale."""
    down = sd.get(f"{name}.lora_down.weight", sd.get(f"{name}.lora_A.weight")).double()
    up = sd.get(f"{name}.lora_up.weight", sd.get(f"{name}.lora_B.weight")).double().flatten(1)
    mid = sd.get(f"{name}.lora_mid.weight")
    if mid is not None:
        return torch.einsum("oa,abhw,bi->oihw", up, mid.double(), down.flatten(1))
    if down.dim() == 4:
        return torch.einsum("oa,aihw->oihw", up, down)
    return up @ down


def ulp(t: torch.Tensor) -> torch.Tensor:
    a = t.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))).double() - a.double()


def assert_rounded_once(merged: torch.Tensor, ref64: torch.Tensor) -> None:
    expected = ref64.to(merged.dtype)
    differ = merged != expected
    n = int(differ.sum())
    assert n <= max(1, merged.numel() // 1000), (
        f"{n} of {merged.numel()} elements differ from the rounded reference"
    )
    if n:
        gap = (merged.double() - expected.double()).abs()[differ]
        assert bool((gap <= ulp(expected)[differ]).all()), "a merged element is more than one ulp off"


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_state_equal(model: nn.Module, ref: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert now.keys() == ref.keys()
    for k, v in now.items():
        assert v.dtype == ref[k].dtype and torch.equal(v, ref[k]), k


def assert_no_loraweave_hooks(model: nn.Module, allowed: dict[str, int] | None = None) -> None:
    allowed = allowed or {}
    for name, module in model.named_modules():
        assert len(module._forward_hooks) == allowed.get(name, 0), name


# ---------------------------------------------------------------------------------- merge: linear layers


@pytest.mark.parametrize("factor_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("alpha", [None, 3.0])
def test_merge_fp32_matches_fp64_reference(factor_dtype, alpha):
    model = container(fc=linear(48, 40, seed=1))
    before = state(model)
    sd = lora_sd("fc", 40, 48, rank=4, seed=2, alpha=alpha, dtype=factor_dtype)
    s = 0.7
    handle = loraweave.apply(model, (sd, s), mode="merge", strict=True)
    scale = (alpha / 4) if alpha is not None else 1.0
    ref = before["fc.weight"].double() + s * scale * delta_of(sd, "fc")
    assert rel_err(model.fc.weight, ref) <= MERGE_TOL
    assert model.fc.weight.dtype == torch.float32
    assert torch.equal(model.fc.bias, before["fc.bias"])
    source = "tensor:alpha" if alpha is not None else "default:1"
    assert handle.report.adapters[0]["alpha_sources"] == {source: 1}
    handle.remove()
    assert_state_equal(model, before)


def test_merge_fp32_with_several_adapters_matches_fp64_reference():
    model = container(fc=linear(32, 24, seed=3))
    before = state(model)
    a = lora_sd("fc", 24, 32, rank=2, seed=4, alpha=1.0)
    b = lora_sd("fc", 24, 32, rank=6, seed=5, dtype=torch.float16, peft=True)
    c = {"fc.diff": torch.randn(24, 32, generator=gen(6)) * 0.05}
    spec = [
        (loraweave.load_adapter(a, name="a"), 0.5),
        (loraweave.load_adapter(b, name="b"), -1.25),
        (loraweave.load_adapter(c, name="c"), 2.0),
    ]
    handle = loraweave.apply(model, spec, mode="merge", strict=True)
    ref = (
        before["fc.weight"].double()
        + 0.5 * 0.5 * delta_of(a, "fc")
        - 1.25 * delta_of(b, "fc")
        + 2.0 * c["fc.diff"].double()
    )
    assert rel_err(model.fc.weight, ref) <= MERGE_TOL
    handle.remove()
    assert_state_equal(model, before)


def test_merge_fp64_weight_keeps_fp64_precision():
    """A float64 layer must not come back from a merge rounded to fp32 (strength 0 must be a no-op)."""
    model = container(fc=linear(24, 16, seed=7, dtype=torch.float64))
    before = state(model)
    sd = lora_sd("fc", 16, 24, rank=3, seed=8, alpha=2.0)
    handle = loraweave.apply(model, (sd, 0.0), mode="merge", strict=True)
    assert torch.equal(model.fc.weight, before["fc.weight"]), "merging at strength 0 changed a float64 weight"
    handle.remove()
    handle = loraweave.apply(model, (sd, 0.9), mode="merge", strict=True)
    ref = before["fc.weight"] + 0.9 * (2.0 / 3) * delta_of(sd, "fc")
    assert rel_err(model.fc.weight, ref) <= 1e-12
    handle.remove()
    assert_state_equal(model, before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_adapters", [1, 2])
def test_merge_low_precision_weight_rounds_once(dtype, n_adapters):
    model = container(fc=linear(96, 64, seed=9, dtype=dtype))
    before = state(model)
    sds = [
        lora_sd("fc", 64, 96, rank=4, seed=10, alpha=2.0, dtype=dtype),
        lora_sd("fc", 64, 96, rank=8, seed=11, dtype=torch.float32, peft=True),
    ][:n_adapters]
    strengths = [0.3, -0.05][:n_adapters]
    spec = [
        (loraweave.load_adapter(sd, name=f"a{i}"), s)
        for i, (sd, s) in enumerate(zip(sds, strengths, strict=True))
    ]
    handle = loraweave.apply(model, spec, mode="merge", strict=True)
    scales = [0.5, 1.0]
    ref = before["fc.weight"].double()
    for sd, s, g in zip(sds, strengths, scales, strict=False):
        ref = ref + s * g * delta_of(sd, "fc")
    assert model.fc.weight.dtype == dtype
    assert_rounded_once(model.fc.weight, ref)
    assert torch.equal(model.fc.bias, before["fc.bias"])
    handle.remove()
    assert_state_equal(model, before)


# ---------------------------------------------------------------------------------- conv: LoCon and Tucker


CONV_GEOMETRIES = [
    {"stride": 1, "padding": 1, "dilation": 1},
    {"stride": 2, "padding": 1, "dilation": 1},
    {"stride": 1, "padding": 2, "dilation": 2},
]


def _conv_model(geo: dict, seed: int = 12) -> nn.Module:
    torch.manual_seed(seed)
    return container(conv=nn.Conv2d(4, 6, 3, **geo))


def _conv_sd(tucker: bool, rank: int = 3, seed: int = 13) -> dict[str, torch.Tensor]:
    g = gen(seed)
    if tucker:
        return {
            "conv.lora_down.weight": torch.randn(rank, 4, 1, 1, generator=g),
            "conv.lora_mid.weight": torch.randn(rank, rank, 3, 3, generator=g),
            "conv.lora_up.weight": torch.randn(6, rank, 1, 1, generator=g),
            "conv.alpha": torch.tensor(2.0),
        }
    return {
        "conv.lora_down.weight": torch.randn(rank, 4, 3, 3, generator=g),
        "conv.lora_up.weight": torch.randn(6, rank, 1, 1, generator=g),
        "conv.alpha": torch.tensor(2.0),
    }


def _sequential_conv_reference(x, conv: nn.Conv2d, sd, coeff: float, geo: dict) -> torch.Tensor:
    """LyCORIS-style forward in fp64: base conv + coeff * up(mid(down(x))) with the layer's geometry on the
    kernel-carrying conv (down for LoCon, mid for Tucker)."""
    x = x.double()
    base = F.conv2d(x, conv.weight.double(), conv.bias.double(), **geo)
    down = sd["conv.lora_down.weight"].double()
    if "conv.lora_mid.weight" in sd:
        h = F.conv2d(x, down)
        h = F.conv2d(h, sd["conv.lora_mid.weight"].double(), **geo)
    else:
        h = F.conv2d(x, down, **geo)
    return base + coeff * F.conv2d(h, sd["conv.lora_up.weight"].double())


@pytest.mark.parametrize("tucker", [False, True], ids=["locon", "tucker"])
@pytest.mark.parametrize("geo", CONV_GEOMETRIES, ids=["s1p1", "s2p1", "d2p2"])
def test_conv_merge_and_runtime_match_independent_references(tucker, geo):
    model = _conv_model(geo)
    before = state(model)
    sd = _conv_sd(tucker)
    s, coeff = 0.8, 0.8 * 2.0 / 3
    x = torch.randn(2, 4, 9, 9, generator=gen(14))
    ref_w = before["conv.weight"].double() + coeff * delta_of(sd, "conv")
    ref_out = F.conv2d(x.double(), ref_w, before["conv.bias"].double(), **geo)
    assert (
        rel_err(_sequential_conv_reference(x, model.conv, sd, coeff, geo), ref_out) <= 1e-12
    )  # the references agree

    handle = loraweave.apply(model, (sd, s), mode="merge", strict=True)
    assert rel_err(model.conv.weight, ref_w) <= MERGE_TOL
    assert handle.report.adapters[0]["alpha_sources"] == {"tensor:alpha": 1}
    with torch.no_grad():
        merged_out = model.conv(x)
    handle.remove()
    assert_state_equal(model, before)

    with torch.no_grad(), loraweave.apply(model, (sd, s), mode="runtime", strict=True) as handle:
        assert [m.mechanism for m in handle.report.applied] == ["runtime"]
        out = model.conv(x)
        assert_state_equal(model, before)
    assert rel_err(out, ref_out) <= RUNTIME_TOL
    assert (
        rel_err(out, F.conv2d(x, ref_w.float(), before["conv.bias"], **geo)) <= RUNTIME_TOL
    )  # F.conv2d of merged weight
    assert rel_err(merged_out, out) <= RUNTIME_TOL
    assert_no_loraweave_hooks(model)
    with torch.no_grad():
        assert torch.equal(model.conv(x), F.conv2d(x, before["conv.weight"], before["conv.bias"], **geo))


def test_conv_1x1_takes_linear_shaped_factors():
    torch.manual_seed(15)
    model = container(conv=nn.Conv2d(5, 7, 1))
    before = state(model)
    sd = lora_sd("conv", 7, 5, rank=2, seed=16, alpha=1.0)
    x = torch.randn(1, 5, 4, 4, generator=gen(17))
    ref_w = before["conv.weight"].double() + 0.5 * delta_of(sd, "conv").reshape(7, 5, 1, 1)
    with loraweave.apply(model, sd, mode="merge", strict=True):
        assert rel_err(model.conv.weight, ref_w) <= MERGE_TOL
    with torch.no_grad(), loraweave.apply(model, sd, mode="runtime", strict=True):
        out = model.conv(x)
    assert rel_err(out, F.conv2d(x.double(), ref_w, before["conv.bias"].double())) <= RUNTIME_TOL


# ------------------------------------------------------------------------------------------ set_strength


def _two_adapter_model():
    torch.manual_seed(18)
    return container(fc=linear(16, 12, seed=18), conv=nn.Conv2d(3, 4, 3, padding=1))


def _two_adapters():
    a = {
        **lora_sd("fc", 12, 16, rank=2, seed=19, alpha=4.0),
        **lora_sd("conv", 4, 3, rank=2, seed=20, alpha=1.0, kernel=3),
    }
    b = {
        **lora_sd("fc", 12, 16, rank=3, seed=21, peft=True),
        "conv.diff": torch.randn(4, 3, 3, 3, generator=gen(22)) * 0.1,
    }
    return loraweave.load_adapter(a, name="a"), loraweave.load_adapter(b, name="b"), a, b


def _run(model, x, img):
    with torch.no_grad():
        return model.fc(x), model.conv(img)


def test_runtime_set_strength_is_a_scale_update_equal_to_a_fresh_apply():
    base = _two_adapter_model()
    ad_a, ad_b, a, b = _two_adapters()
    x, img = torch.randn(5, 16, generator=gen(23)), torch.randn(2, 3, 6, 6, generator=gen(24))
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, [(ad_a, 1.0), (ad_b, 0.5)], mode="runtime", strict=True)
    paths = {id(rp.module): rp for rp in handle.runtime_paths}
    fc_path = paths[id(model.fc)]
    assert fc_path.down.shape[0] == 5 and fc_path.up.shape == (12, 5)  # one rank-concatenated pair
    factors = [(rp, rp.down, rp.up) for rp in handle.runtime_paths]
    for value in (-0.4, 0.0, 2.5):
        handle.set_strength("a", value)
        assert handle.strengths == {"a": value, "b": 0.5}
        assert [s["strength"] for s in handle.report.adapters] == [value, 0.5]
        for rp, down, up in factors:
            assert rp.down is down and rp.up is up, "set_strength rebuilt the factors"
        out_fc, out_conv = _run(model, x, img)
        fresh_model = copy.deepcopy(base)
        with loraweave.apply(fresh_model, [(ad_a, value), (ad_b, 0.5)], mode="runtime", strict=True):
            fresh_fc, fresh_conv = _run(fresh_model, x, img)
        assert rel_err(out_fc, fresh_fc) <= 1e-6
        assert rel_err(out_conv, fresh_conv) <= 1e-6
        ref_w = base.fc.weight.double() + value * 2.0 * delta_of(a, "fc") + 0.5 * delta_of(b, "fc")
        assert rel_err(out_fc, F.linear(x.double(), ref_w, base.fc.bias.double())) <= RUNTIME_TOL
        ref_c = base.conv.weight.double() + value * 0.5 * delta_of(a, "conv") + 0.5 * b["conv.diff"].double()
        assert (
            rel_err(out_conv, F.conv2d(img.double(), ref_c, base.conv.bias.double(), padding=1))
            <= RUNTIME_TOL
        )
    handle.remove()
    assert_state_equal(model, state(base))
    assert_no_loraweave_hooks(model)
    with pytest.raises(RuntimeError):
        handle.set_strength("a", 1.0)


def test_runtime_set_strength_on_a_bf16_layer_rewrites_the_cast_scale_in_place_bit_equal_to_fresh():
    """A bf16 layer computes with a bf16 copy of the per-rank scale: a strength change writes the new values
    into that copy (no new allocation, no host sync on an accelerator) and equals a fresh apply bit for
    bit."""
    base = _two_adapter_model().to(torch.bfloat16)
    ad_a, ad_b, _, _ = _two_adapters()
    x = torch.randn(5, 16, generator=gen(25)).to(torch.bfloat16)
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, [(ad_a, 1.0), (ad_b, 0.5)], mode="runtime", strict=True)
    fc_path = {id(rp.module): rp for rp in handle.runtime_paths}[id(model.fc)]
    with torch.no_grad():
        model.fc(x)
    (cast,) = fc_path._scale_cast._cast
    assert cast.dtype == torch.bfloat16 and cast is not fc_path.scale
    for value in (-0.4, 0.3, 2.5):
        handle.set_strength("a", value)
        assert fc_path._scale_cast._cast[0] is cast
        assert torch.equal(cast, fc_path.scale.to(torch.bfloat16))
        fresh = copy.deepcopy(base)
        with (
            torch.no_grad(),
            loraweave.apply(fresh, [(ad_a, value), (ad_b, 0.5)], mode="runtime", strict=True),
        ):
            assert torch.equal(model.fc(x), fresh.fc(x))
    handle.remove()


def test_merge_set_strength_equals_a_fresh_merge_bit_exactly():
    torch.manual_seed(25)
    base = container(
        f32=linear(16, 12, seed=25),
        multi=linear(16, 12, seed=26),
        f16=linear(16, 8, seed=27, dtype=torch.float16),
        bf16=linear(16, 8, seed=28, dtype=torch.bfloat16),
        conv=nn.Conv2d(3, 4, 3, padding=1),
    )
    a = {
        **lora_sd("f32", 12, 16, rank=2, seed=29, alpha=1.0),
        **lora_sd("multi", 12, 16, rank=4, seed=30, peft=True),
        "multi.lora_B.bias": torch.randn(12, generator=gen(31)),
        **lora_sd("f16", 8, 16, rank=2, seed=32, dtype=torch.float16),
        **lora_sd("bf16", 8, 16, rank=2, seed=33, alpha=8.0),
        **lora_sd("conv", 4, 3, rank=2, seed=34, kernel=3),
    }
    b = {
        **lora_sd("multi", 12, 16, rank=3, seed=35),
        "f16.diff": torch.randn(8, 16, generator=gen(36)) * 0.1,
        "f16.diff_b": torch.randn(8, generator=gen(37)),
    }
    ad_a, ad_b = loraweave.load_adapter(a, name="a"), loraweave.load_adapter(b, name="b")
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, [(ad_a, 1.0), (ad_b, 0.75)], mode="merge", strict=True)
    for value in (0.3, -1.7, 0.0, 1.0):
        handle.set_strength("a", value)
        fresh = copy.deepcopy(base)
        loraweave.apply(fresh, [(ad_a, value), (ad_b, 0.75)], mode="merge", strict=True)
        assert_state_equal(model, state(fresh))
    handle.set_strength("b", -2.0)
    fresh = copy.deepcopy(base)
    loraweave.apply(fresh, [(ad_a, 1.0), (ad_b, -2.0)], mode="merge", strict=True)
    assert_state_equal(model, state(fresh))
    handle.remove()
    assert_state_equal(model, state(base))


def test_two_adapters_at_runtime_equal_the_sum_of_both_deltas():
    base = container(fc=linear(20, 10, seed=38))
    a = lora_sd("fc", 10, 20, rank=4, seed=39, alpha=2.0)
    b = lora_sd("fc", 10, 20, rank=1, seed=40, peft=True, dtype=torch.bfloat16)
    x = torch.randn(3, 7, 20, generator=gen(41))  # 3-d input: batch x tokens x features
    model = copy.deepcopy(base)
    spec = [(loraweave.load_adapter(a, name="a"), 0.6), (loraweave.load_adapter(b, name="b"), -0.3)]
    with torch.no_grad(), loraweave.apply(model, spec, mode="runtime", strict=True) as handle:
        assert len(handle.runtime_paths) == 1
        out = model.fc(x)
    ref_w = base.fc.weight.double() + 0.6 * 0.5 * delta_of(a, "fc") - 0.3 * delta_of(b, "fc")
    assert rel_err(out, F.linear(x.double(), ref_w, base.fc.bias.double())) <= RUNTIME_TOL
    # each alone adds its own part: the sum of the two single-adapter deltas is the joint delta
    deltas = []
    for item in spec:
        with torch.no_grad(), loraweave.apply(model, [item], mode="runtime"):
            deltas.append(model.fc(x) - base.fc(x))
    with torch.no_grad():
        assert rel_err(out - base.fc(x), deltas[0] + deltas[1]) <= RUNTIME_TOL


def test_runtime_under_autograd_matches_and_backpropagates():
    base = container(fc=linear(16, 12, seed=42))
    sd = lora_sd("fc", 12, 16, rank=2, seed=43, alpha=1.0)
    model = copy.deepcopy(base)
    x = torch.randn(4, 16, generator=gen(44), requires_grad=True)
    ref_w = base.fc.weight.double() + 0.5 * delta_of(sd, "fc")
    with loraweave.apply(model, sd, mode="runtime", strict=True):
        out = model.fc(x)
        out.sum().backward()
    assert rel_err(out.detach(), F.linear(x.detach().double(), ref_w, base.fc.bias.double())) <= RUNTIME_TOL
    assert rel_err(x.grad, ref_w.sum(0).expand(4, -1)) <= RUNTIME_TOL
    assert_state_equal(model, state(base))


# ------------------------------------------------------------------------------- bias deltas and full diffs


def test_lora_b_bias_delta_merged_and_at_runtime():
    base = container(fc=linear(10, 8, seed=45))
    sd = {
        **lora_sd("fc", 8, 10, rank=2, seed=46, peft=True),
        "fc.lora_B.bias": torch.randn(8, generator=gen(47)),
    }
    sd["fc.alpha"] = torch.tensor(4.0)
    s, coeff = 0.9, 0.9 * 2.0
    ref_w = base.fc.weight.double() + coeff * delta_of(sd, "fc")
    ref_b = base.fc.bias.double() + coeff * sd["fc.lora_B.bias"].double()
    x = torch.randn(3, 10, generator=gen(48))
    model = copy.deepcopy(base)
    with loraweave.apply(model, (sd, s), mode="merge", strict=True):
        assert rel_err(model.fc.weight, ref_w) <= MERGE_TOL
        assert rel_err(model.fc.bias, ref_b) <= MERGE_TOL
    assert_state_equal(model, state(base))
    with torch.no_grad(), loraweave.apply(model, (sd, s), mode="runtime", strict=True):
        out = model.fc(x)
    assert rel_err(out, F.linear(x.double(), ref_w, ref_b)) <= RUNTIME_TOL


class OneLayer(nn.Module):
    def __init__(self, fc: nn.Module) -> None:
        super().__init__()
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


@pytest.mark.filterwarnings("ignore:Adapter 'default'")
def test_lora_b_bias_matches_peft(tmp_path):
    """PEFT (lora_bias=True) scales lora_B.bias by alpha/r, like the weight delta."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    base = OneLayer(linear(10, 8, seed=49))
    cfg = LoraConfig(r=2, lora_alpha=6, lora_bias=True, init_lora_weights=False, target_modules=["fc"])
    torch.manual_seed(50)
    peft_model = get_peft_model(copy.deepcopy(base), cfg)
    for name, p in peft_model.named_parameters():
        if name.endswith("lora_B.default.bias"):
            with torch.no_grad():
                p.copy_(torch.randn(8, generator=gen(51)))
    sd = get_peft_model_state_dict(peft_model)
    assert any(k.endswith("lora_B.bias") for k in sd)
    path = tmp_path / "peft_bias.safetensors"
    save_file(
        {k: v.contiguous() for k, v in sd.items()},
        str(path),
        metadata={"lora_adapter_metadata": json.dumps({"r": 2, "lora_alpha": 6})},
    )
    x = torch.randn(3, 10, generator=gen(52))
    with torch.no_grad():
        ref = peft_model(x)
        model = copy.deepcopy(base)
        for mode in ("merge", "runtime"):
            with loraweave.apply(model, path, mode=mode, strict=True) as handle:
                assert handle.report.adapters[0]["alpha_sources"] == {"metadata:peft": 1}
                assert rel_err(model.fc(x), ref) <= RUNTIME_TOL, mode
        assert_state_equal(model, state(base))


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_full_diff_and_diff_b_merged_and_at_runtime(kind):
    torch.manual_seed(53)
    if kind == "linear":
        base = container(m=linear(9, 7, seed=53))
        diff = torch.randn(7, 9, generator=gen(54)) * 0.1
        x = torch.randn(4, 9, generator=gen(55))

        def fwd(w, b, inp):
            return F.linear(inp, w, b)
    else:
        base = container(m=nn.Conv2d(3, 5, 3, padding=1))
        diff = torch.randn(5, 3, 3, 3, generator=gen(54)) * 0.1
        x = torch.randn(2, 3, 6, 6, generator=gen(55))

        def fwd(w, b, inp):
            return F.conv2d(inp, w, b, padding=1)

    diff_b = torch.randn(diff.shape[0], generator=gen(56))
    s = -0.6
    ref_w = base.m.weight.double() + s * diff.double()
    ref_b = base.m.bias.double() + s * diff_b.double()
    for sd, w, b in [
        ({"m.diff": diff, "m.diff_b": diff_b}, ref_w, ref_b),
        ({"m.diff": diff}, ref_w, base.m.bias.double()),
        ({"m.diff_b": diff_b}, base.m.weight.double(), ref_b),
    ]:
        model = copy.deepcopy(base)
        with loraweave.apply(model, (sd, s), mode="merge", strict=True) as handle:
            assert handle.report.adapters[0]["alpha_sources"] == {"none:full": 1}
            assert rel_err(model.m.weight, w) <= MERGE_TOL
            assert rel_err(model.m.bias, b) <= MERGE_TOL
        assert_state_equal(model, state(base))
        with torch.no_grad(), loraweave.apply(model, (sd, s), mode="runtime", strict=True):
            out = model.m(x)
        assert rel_err(out, fwd(w, b, x.double())) <= RUNTIME_TOL
        assert_state_equal(model, state(base))


# ------------------------------------------------------------------------------------------- alpha sources


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(57)
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].fc1 = linear(12, 10, seed=57)
        self.blocks[0].fc2 = linear(10, 10, seed=58)
        self.blocks[0].fc3 = linear(10, 6, seed=59)
        self.blocks[0].conv = nn.Conv2d(3, 4, 3, padding=1)


def _check_merge(
    model: nn.Module, base: nn.Module, sd: dict, scales: dict[str, float], strength: float = 1.0
) -> None:
    for name, scale in scales.items():
        key = name.replace(".", "_")
        stem = next(k for k in (f"lora_unet_{key}", name) if any(s.startswith(k + ".") for s in sd))
        ref = base.get_submodule(name).weight.double() + strength * scale * delta_of(sd, stem)
        assert rel_err(model.get_submodule(name).weight, ref) <= MERGE_TOL, (name, scale)


def test_alpha_source_alpha_tensor_wins_over_metadata(tmp_path):
    base = Blocks()
    sd = {
        **lora_sd("blocks.0.fc1", 10, 12, rank=4, seed=60, alpha=2.0),
        **lora_sd("blocks.0.fc2", 10, 10, rank=2, seed=61),
    }
    path = tmp_path / "a.safetensors"
    save_file(sd, str(path), metadata={"ss_network_alpha": "8"})
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, path, mode="merge", strict=True)
    assert handle.report.adapters[0]["alpha_sources"] == {"tensor:alpha": 1, "metadata:ss_network_alpha": 1}
    _check_merge(model, base, sd, {"blocks.0.fc1": 2.0 / 4, "blocks.0.fc2": 8.0 / 2})


def test_alpha_source_kohya_metadata_and_conv_alpha(tmp_path):
    base = Blocks()
    sd = {
        **lora_sd("lora_unet_blocks_0_fc1", 10, 12, rank=4, seed=62),
        **lora_sd("lora_unet_blocks_0_conv", 4, 3, rank=2, seed=63, kernel=3),
    }
    path = tmp_path / "kohya.safetensors"
    save_file(
        sd, str(path), metadata={"ss_network_alpha": "2", "ss_network_args": json.dumps({"conv_alpha": 1})}
    )
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, (path, 0.5), mode="merge", strict=True)
    assert handle.report.adapters[0]["alpha_sources"] == {
        "metadata:ss_network_alpha": 1,
        "metadata:conv_alpha": 1,
    }
    _check_merge(model, base, sd, {"blocks.0.fc1": 2.0 / 4, "blocks.0.conv": 1.0 / 2}, strength=0.5)
    # without conv_alpha, the conv takes ss_network_alpha
    path2 = tmp_path / "kohya2.safetensors"
    save_file(sd, str(path2), metadata={"ss_network_alpha": "2"})
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, path2, mode="merge", strict=True)
    assert handle.report.adapters[0]["alpha_sources"] == {"metadata:ss_network_alpha": 2}
    _check_merge(model, base, sd, {"blocks.0.fc1": 2.0 / 4, "blocks.0.conv": 2.0 / 2})


def test_alpha_zero_means_rank_as_kohya_and_lycoris_read_it(tmp_path):
    """An `.alpha` of 0 (or ss_network_alpha 0) is alpha = rank: the scale LyCORIS's own module gives it."""
    from lycoris.modules.locon import LoConModule

    peer = LoConModule("x", nn.Linear(12, 10), multiplier=1.0, lora_dim=4, alpha=0)
    assert peer.scale == 1.0  # the peer's reading, checked here so the reference cannot drift unseen
    base = Blocks()
    sd = {
        **lora_sd("blocks.0.fc1", 10, 12, rank=4, seed=66, alpha=0.0),
        **lora_sd("lora_unet_blocks_0_fc2", 10, 10, rank=2, seed=67),
    }
    path = tmp_path / "zero.safetensors"
    save_file(sd, str(path), metadata={"ss_network_alpha": "0"})
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, path, mode="merge", strict=True)
    assert handle.report.adapters[0]["alpha_sources"] == {
        "tensor:alpha=0_as_rank": 1,
        "metadata:ss_network_alpha=0_as_rank": 1,
    }
    _check_merge(model, base, sd, {"blocks.0.fc1": peer.scale, "blocks.0.fc2": peer.scale})


def _peft_sd() -> dict[str, torch.Tensor]:
    return {
        **lora_sd("blocks.0.fc1", 10, 12, rank=4, seed=64, peft=True),
        **lora_sd("blocks.0.fc2", 10, 10, rank=4, seed=65, peft=True),
        **lora_sd("blocks.0.fc3", 6, 10, rank=2, seed=66, peft=True),
    }


@pytest.mark.parametrize("rslora", [False, True])
def test_alpha_source_peft_metadata_with_patterns(tmp_path, rslora):
    base = Blocks()
    sd = _peft_sd()
    meta = {
        "r": 4,
        "lora_alpha": 8,
        "alpha_pattern": {"fc2": 2},
        "rank_pattern": {"fc3": 2},
        "use_rslora": rslora,
    }
    path = tmp_path / "peft.safetensors"
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(meta)})
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, path, mode="merge", strict=True)
    root = (lambda r: math.sqrt(r)) if rslora else (lambda r: r)
    suffix = "_rslora" if rslora else ""
    assert handle.report.adapters[0]["alpha_sources"] == {
        f"metadata:peft{suffix}": 1,
        f"metadata:peft_pattern{suffix}": 2,
    }
    _check_merge(
        model,
        base,
        sd,
        {"blocks.0.fc1": 8 / root(4), "blocks.0.fc2": 2 / root(4), "blocks.0.fc3": 8 / root(2)},
    )


def test_alpha_source_peft_directory_with_adapter_config(tmp_path):
    base = Blocks()
    sd = _peft_sd()
    save_file(sd, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 2, "rank_pattern": {"fc3": 2}})
    )
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, tmp_path, mode="merge", strict=True)
    assert handle.report.adapters[0]["alpha_sources"] == {"metadata:peft": 2, "metadata:peft_pattern": 1}
    _check_merge(model, base, sd, {"blocks.0.fc1": 0.5, "blocks.0.fc2": 0.5, "blocks.0.fc3": 1.0})


def test_alpha_source_none_means_scale_one(tmp_path):
    base = Blocks()
    sd = _peft_sd()
    path = tmp_path / "plain.safetensors"
    save_file(sd, str(path), metadata={"format": "pt"})
    for source in (path, sd):
        model = copy.deepcopy(base)
        handle = loraweave.apply(model, source, mode="merge", strict=True)
        assert handle.report.adapters[0]["alpha_sources"] == {"default:1": 3}
        _check_merge(model, base, sd, {"blocks.0.fc1": 1.0, "blocks.0.fc2": 1.0, "blocks.0.fc3": 1.0})


@pytest.mark.parametrize(
    "pattern",
    ["fc2", "0.fc2", r"blocks\.0\.fc2", "blocks.0.fc2", "fc1|fc2", "fc[23]", ".*fc2", "c2"],
)
def test_peft_alpha_pattern_matches_like_peft(tmp_path, pattern):
    """alpha_pattern keys are regexes matched the way PEFT matches them (peft.utils.other.get_pattern_key)."""
    from peft.utils.other import get_pattern_key

    base = Blocks()
    sd = _peft_sd()
    meta = {"r": 4, "lora_alpha": 8, "alpha_pattern": {pattern: 2}, "rank_pattern": {"fc3": 2}}
    path = tmp_path / "pattern.safetensors"
    save_file(sd, str(path), metadata={"lora_adapter_metadata": json.dumps(meta)})
    model = copy.deepcopy(base)
    loraweave.apply(model, path, mode="merge", strict=True)
    expected = {}
    for name in ("blocks.0.fc1", "blocks.0.fc2", "blocks.0.fc3"):
        alpha = meta["alpha_pattern"].get(
            get_pattern_key(meta["alpha_pattern"].keys(), name), meta["lora_alpha"]
        )
        r = meta["rank_pattern"].get(get_pattern_key(meta["rank_pattern"].keys(), name), meta["r"])
        expected[name] = alpha / r
    _check_merge(model, base, sd, expected)


# --------------------------------------------------------------------------------------- foreign hooks


def test_runtime_on_a_module_with_foreign_hooks():
    base = container(fc=linear(10, 8, seed=67))
    sd = lora_sd("fc", 8, 10, rank=2, seed=68, alpha=1.0)
    model = copy.deepcopy(base)
    seen = []
    model.fc.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model.fc.register_forward_hook(lambda m, args, out: seen.append(out.detach().clone()))
    model.fc.register_forward_hook(lambda m, args, out: out.clone())
    x = torch.randn(3, 10, generator=gen(69))
    with torch.no_grad():
        out_before = model.fc(x)
    ref_w = base.fc.weight.double() + 0.7 * 0.5 * delta_of(sd, "fc")
    with torch.no_grad(), loraweave.apply(model, (sd, 0.7), mode="runtime", strict=True):
        out = model.fc(x)
    # the layer sees the pre-hook's input (2x) in both its weight and the LoRA path
    assert rel_err(out, F.linear(2 * x.double(), ref_w, base.fc.bias.double())) <= RUNTIME_TOL
    assert len(model.fc._forward_hooks) == 2 and len(model.fc._forward_pre_hooks) == 1  # foreign hooks kept
    with torch.no_grad():
        assert torch.equal(model.fc(x), out_before)
    # Observers see the layer's real output: with the LoRA while applied, the base output after removal.
    assert torch.equal(seen[1], out) and torch.equal(seen[2], out_before)


def test_runtime_with_accelerate_hooks():
    import accelerate.hooks as hooks

    base = container(fc=linear(10, 8, seed=70), conv=nn.Conv2d(3, 4, 3, padding=1))
    sd = {
        **lora_sd("fc", 8, 10, rank=2, seed=71, alpha=1.0),
        **lora_sd("conv", 4, 3, rank=2, seed=72, kernel=3),
    }
    x, img = torch.randn(3, 10, generator=gen(73)), torch.randn(1, 3, 5, 5, generator=gen(74))
    ref_w = base.fc.weight.double() + 0.5 * delta_of(sd, "fc")
    ref_c = base.conv.weight.double() + delta_of(sd, "conv")
    ref_fc = F.linear(x.double(), ref_w, base.fc.bias.double())
    ref_conv = F.conv2d(img.double(), ref_c, base.conv.bias.double(), padding=1)

    # accelerate hook present before apply
    model = copy.deepcopy(base)
    hooks.add_hook_to_module(model.fc, hooks.ModelHook())
    hooks.add_hook_to_module(model.conv, hooks.ModelHook())
    with torch.no_grad():
        before = _run(model, x, img)
        with loraweave.apply(model, sd, mode="runtime", strict=True):
            out_fc, out_conv = _run(model, x, img)
        assert rel_err(out_fc, ref_fc) <= RUNTIME_TOL and rel_err(out_conv, ref_conv) <= RUNTIME_TOL
        after = _run(model, x, img)
        assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
        assert hasattr(model.fc, "_hf_hook") and hasattr(model.conv, "_hf_hook")
        # a plain (non-offloading) accelerate hook does not stop auto from merging
        with loraweave.apply(model, sd, mode="auto", strict=True) as handle:
            assert {m.mechanism for m in handle.report.applied} == {"merge"}
            assert rel_err(model.fc(x), ref_fc) <= RUNTIME_TOL

    # accelerate hook added after apply
    model = copy.deepcopy(base)
    with torch.no_grad():
        handle = loraweave.apply(model, sd, mode="runtime", strict=True)
        hooks.add_hook_to_module(model.fc, hooks.ModelHook())
        out_fc, out_conv = _run(model, x, img)
        assert rel_err(out_fc, ref_fc) <= RUNTIME_TOL and rel_err(out_conv, ref_conv) <= RUNTIME_TOL
        handle.remove()
        hooks.remove_hook_from_module(model.fc)
        after = _run(model, x, img)
        assert torch.equal(after[0], base.fc(x)) and torch.equal(after[1], base.conv(img))
    assert_no_loraweave_hooks(model)


# ----------------------------------------------------------------------------------- quantized (int8) layer


class Int8Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, seed: int) -> None:
        super().__init__()
        g = gen(seed)
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight", torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
        )
        self.register_buffer("scale", torch.rand(out_features, generator=g) * 0.02 + 0.001)
        self.bias = nn.Parameter(torch.randn(out_features, generator=g) * 0.1)

    def dequantised(self) -> torch.Tensor:
        return self.weight.double() * self.scale.double()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.float() * self.scale[:, None], self.bias)


def test_auto_on_an_int8_layer_chooses_runtime():
    torch.manual_seed(75)
    base = container(q=Int8Linear(12, 10, seed=75), fc=linear(10, 10, seed=76))
    sd = {**lora_sd("q", 10, 12, rank=3, seed=77, alpha=1.5), **lora_sd("fc", 10, 10, rank=2, seed=78)}
    x = torch.randn(4, 12, generator=gen(79))
    model = copy.deepcopy(base)
    with torch.no_grad():
        base_out = model.q(x)
        handle = loraweave.apply(model, (sd, 0.8), mode="auto", strict=True)
        mech = {m.module: m for m in handle.report.applied}
        assert mech["q"].mechanism == "runtime" and "int8" in mech["q"].why
        assert mech["fc"].mechanism == "merge"
        out = model.q(x)
        lora_path = (
            0.8
            * 0.5
            * (x.double() @ sd["q.lora_down.weight"].double().t() @ sd["q.lora_up.weight"].double().t())
        )
        assert rel_err(out, base_out.double() + lora_path) <= RUNTIME_TOL
        ref = F.linear(x.double(), base.q.dequantised() + 0.8 * 0.5 * delta_of(sd, "q"), base.q.bias.double())
        assert rel_err(out, ref) <= RUNTIME_TOL
        assert torch.equal(model.q.weight, base.q.weight) and torch.equal(model.q.scale, base.q.scale)
        handle.remove()
        assert torch.equal(model.q(x), base_out)
    assert_state_equal(model, state(base))
    assert_no_loraweave_hooks(model)


def test_merge_on_an_int8_layer_is_reported():
    base = container(q=Int8Linear(12, 10, seed=80), fc=linear(10, 10, seed=81))
    sd = {**lora_sd("q", 10, 12, rank=3, seed=82, alpha=1.5), **lora_sd("fc", 10, 10, rank=2, seed=83)}
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, sd, mode="merge")
    d = handle.report.to_dict()
    json.dumps(d)
    assert {m["key"] for m in d["unmatched"]} == {"q.lora_down.weight", "q.lora_up.weight", "q.alpha"}
    assert all(m["reason"].startswith("cannot merge") for m in d["unmatched"])
    assert d["keys_applied"] == 2 and d["keys_applied"] + len(d["unmatched"]) == d["keys_total"] == 5
    assert torch.equal(model.q.weight, base.q.weight) and torch.equal(model.q.bias, base.q.bias)
    assert not torch.equal(model.fc.weight, base.fc.weight)
    handle.remove()
    assert_state_equal(model, state(base))
    # runtime mode takes it
    with loraweave.apply(model, sd, mode="runtime", strict=True) as handle:
        assert {m.mechanism for m in handle.report.applied} == {"runtime"}
    assert_no_loraweave_hooks(model)


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_factors_with_an_autograd_graph_do_not_keep_it_alive(mode):
    """A state dict whose factors were computed with grad (e.g. scaled by a weight's norm) holds that graph;
    the handle keeps the factors but not the graph, so the tensors behind it are freed with the caller's
    refs."""
    import gc
    import weakref

    model = container(fc=linear(48, 40, seed=1))
    source = torch.randn(4, 48, requires_grad=True)
    probe = weakref.ref(source)
    sd = lora_sd("fc", 40, 48, rank=4, seed=2)
    sd["fc.lora_down.weight"] = source * 0.5  # carries a graph back to `source`
    handle = loraweave.apply(model, sd, mode=mode, strict=True)
    del sd, source
    gc.collect()
    assert probe() is None, "the handle keeps the caller's autograd graph alive"
    handle.remove()
