"""LoHa (hada_*): merge and runtime against LyCORIS 4.x's own wrapped forward, fused targets, validation.

Reference = the LyCORIS-wrapped layer's forward (not `merge_to`, which applies alpha/rank twice for LoHa).
Tolerances (rel. error = max|ours - ref| / max|ref|, fp32): <= 1e-5 on the layer outputs and on the adapter's
share of them (output - base output); merged weights against an fp64 reference <= 1e-6 (fp64 weights: 1e-12).
"""

from __future__ import annotations

import copy
import json

import lycoris  # the reference must be installed: a missing package fails here, it is never skipped
import pytest
import torch
from helpers.common import (
    check_fused_flux_qkv,
    gen,
    multiplier_outputs,
    outputs,
    randomise,
    rel_err,
    save_lycoris,
    write_preset,
)
from helpers.family_models import LAYERS, MULTIPLIERS, TOL, Net, inputs
from torch import nn

import loraweave
from loraweave.families import FAMILIES

KERNELS = ("c1", "c2", "c3")  # kernel > 1: Tucker when asked (never for Linear or the 1x1 conv)


# (id, create_lycoris kwargs, rs_lora): alpha != rank everywhere.
OPTIONS = [
    ("default", {"linear_dim": 4, "linear_alpha": 2.0}, False),
    ("conv_dim", {"linear_dim": 4, "linear_alpha": 7.0, "conv_dim": 3, "conv_alpha": 1.5}, False),
    (
        "tucker",
        {"linear_dim": 4, "linear_alpha": 2.0, "conv_dim": 3, "conv_alpha": 5.0, "use_tucker": True},
        False,
    ),
    ("rs_lora", {"linear_dim": 4, "linear_alpha": 3.0, "conv_dim": 2, "conv_alpha": 0.5}, True),
    (
        "rs_lora_tucker",
        {"linear_dim": 5, "linear_alpha": 2.0, "conv_dim": 3, "conv_alpha": 4.0, "use_tucker": True},
        True,
    ),
]


@pytest.mark.parametrize("opt_id, kwargs, rs_lora", OPTIONS, ids=[o[0] for o in OPTIONS])
def test_matches_lycoris_wrapped_forward(tmp_path, lycoris_state, opt_id, kwargs, rs_lora):
    pristine = Net()
    xs = inputs()
    base = outputs(pristine, xs)
    wrapped = copy.deepcopy(pristine)
    preset = write_preset(
        tmp_path / "p.toml", module_algo={"algo": "loha", "rs_lora": True} if rs_lora else None
    )
    net = lycoris.create_lycoris(wrapped, 1.0, algo="loha", preset=preset, **kwargs)
    mods = {m.lora_name.removeprefix("lycoris_"): m for m in net.loras}
    assert sorted(mods) == sorted(LAYERS)
    tucker = kwargs.get("use_tucker", False)
    for name, m in mods.items():
        assert m.rs_lora == rs_lora and m.tucker == (tucker and name in KERNELS) and m.alpha != m.lora_dim, (
            name
        )
    net.apply_to()  # registers the LyCORIS modules: before this, net.parameters() is empty
    params = [p for m in net.loras for p in m.parameters()]
    assert len(params) == 4 * len(LAYERS) + (2 * len(KERNELS) if tucker else 0)
    randomise(params, seed=2, scale=0.5)  # LyCORIS zero-inits hada_w2_a: randomise every factor
    refs = multiplier_outputs(net, wrapped, xs, MULTIPLIERS)
    path = tmp_path / "loha.safetensors"
    saved = save_lycoris(net, path)
    assert any(k.endswith(".hada_t1") for k in saved) == tucker

    for m in MULTIPLIERS:
        got = {}
        for mode in ("merge", "runtime"):
            model = copy.deepcopy(pristine)
            handle = loraweave.apply(model, str(path), mode=mode, strength=m)
            report = handle.report
            assert report.unmatched == [], [(u["key"], u["reason"]) for u in report.unmatched]
            assert report.keys_applied == report.keys_total == len(saved), sorted(saved)
            got[mode] = outputs(model, xs)
            for name in LAYERS:
                ref, ours = refs[m][name], got[mode][name]
                effect = float((ref - base[name]).abs().max() / base[name].abs().max())
                assert effect > 0.05, f"{name}: the adapter has no visible effect ({effect})"
                assert rel_err(ours, ref) <= TOL, (mode, m, name, rel_err(ours, ref))
                assert rel_err(ours - base[name], ref - base[name]) <= TOL, (mode, m, name)
            weights_moved = not torch.equal(model.c2.weight, pristine.c2.weight)
            assert weights_moved == (mode == "merge")
            handle.remove()
            for name, out in outputs(model, xs).items():
                assert torch.equal(out, base[name]), f"{mode}: remove() did not restore {name}"
        for name in LAYERS:
            assert rel_err(got["runtime"][name], got["merge"][name]) <= TOL, (m, name)


# ------------------------------------------------------------------------ fused Flux target (row chunks)


def loha_sd(stem: str, out: int, inp: int, rank: int, seed: int, alpha: float) -> dict[str, torch.Tensor]:
    g = gen(seed)
    sd = {
        f"{stem}.hada_w{i}_{ab}": torch.randn(*shape, generator=g) * 0.5
        for i in (1, 2)
        for ab, shape in (("a", (out, rank)), ("b", (rank, inp)))
    }
    sd[f"{stem}.alpha"] = torch.tensor(alpha)
    return sd


def delta64(sd: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    w = {k.rsplit(".", 1)[1]: v.double() for k, v in sd.items() if k.startswith(stem + ".")}
    return (w["hada_w1_a"] @ w["hada_w1_b"]) * (w["hada_w2_a"] @ w["hada_w2_b"])


def test_fused_flux_qkv_lands_on_the_right_rows():
    from helpers.tiny_models import tiny_flux

    pristine = tiny_flux()
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    sd = loha_sd(stem, 96, 32, rank=4, seed=3, alpha=3.0)
    s = 0.8
    check_fused_flux_qkv(pristine, sd, s, s * (3.0 / 4) * delta64(sd, stem), TOL)


# ------------------------------------------------------------------------ precision, stacking, validation


def test_fp64_merge_and_stacking_with_lora_at_runtime():
    """fp64 weights stay fp64-exact; a LoHa (fn term) and a LoRA (rank pair) on one layer: runtime ==
    merge."""
    torch.manual_seed(5)
    pristine = nn.ModuleDict({"fc": nn.Linear(16, 12).double(), "cv": nn.Conv2d(3, 4, 3, padding=1).double()})
    loha = {
        **loha_sd("fc", 12, 16, rank=3, seed=6, alpha=1.0),
        **loha_sd("cv", 4, 27, rank=2, seed=7, alpha=5.0),
    }
    lora = {
        "fc.lora_down.weight": torch.randn(2, 16, generator=gen(8)),
        "fc.lora_up.weight": torch.randn(12, 2, generator=gen(9)),
    }
    model = copy.deepcopy(pristine)
    handle = loraweave.apply(model, (loha, -0.6), mode="merge", strict=True)
    ref_fc = pristine.fc.weight + -0.6 * (1.0 / 3) * delta64(loha, "fc")
    ref_cv = pristine.cv.weight + -0.6 * (5.0 / 2) * delta64(loha, "cv").view(4, 3, 3, 3)
    assert model.fc.weight.dtype == torch.float64
    assert rel_err(model.fc.weight, ref_fc) <= 1e-12 and rel_err(model.cv.weight, ref_cv) <= 1e-12
    handle.remove()
    xs = {
        "fc": torch.randn(5, 16, generator=gen(10)).float(),
        "cv": torch.randn(2, 3, 6, 6, generator=gen(11)),
    }
    got = {}
    for mode in ("merge", "runtime"):
        model = copy.deepcopy(pristine).float()
        spec = [(loraweave.load_adapter(loha, name="h"), 0.7), (loraweave.load_adapter(lora, name="l"), 0.4)]
        loraweave.apply(model, spec, mode=mode, strict=True)
        got[mode] = outputs(model, xs)
    for name in xs:
        assert rel_err(got["runtime"][name], got["merge"][name]) <= TOL, name


def test_factors_keep_their_dtype_and_tucker_layout():
    sd = {
        "hada_w1_a": torch.randn(3, 6),
        "hada_w1_b": torch.randn(3, 4),
        "hada_t1": torch.randn(3, 3, 3, 3),
        "hada_w2_a": torch.randn(3, 6),
        "hada_w2_b": torch.randn(3, 4),
        "hada_t2": torch.randn(3, 3, 3, 3),
    }
    sd = {k: v.bfloat16() for k, v in sd.items()}
    f = FAMILIES["loha"].load(sd, {k: k for k in sd})
    assert f.rows == 6 and f.rank == 3 and f.is_conv_kernel and f.a1.dtype == torch.bfloat16
    assert FAMILIES["loha"].check_target(f, (6, 4, 3, 3)) is None
    assert FAMILIES["loha"].check_target(f, (6, 4, 3, 1)).kind == "shape_mismatch"
    d = {k: v.double() for k, v in sd.items()}
    rebuild = [
        torch.einsum("ij...,jq,ip->pq...", d[f"hada_t{i}"], d[f"hada_w{i}_b"], d[f"hada_w{i}_a"])
        for i in (1, 2)
    ]
    rows = torch.zeros(2, 36, dtype=torch.float64)
    FAMILIES["loha"].add_delta(rows, f, 3, 2, 2.0)
    assert rel_err(rows, 2.0 * (rebuild[0] * rebuild[1])[3:5].flatten(1)) <= 1e-12


def _reasons(sd: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    report = loraweave.plan(model, sd)
    assert report.keys_applied == 0 and len(report.unmatched) == len(sd)
    return sorted({u["reason"] for u in report.unmatched})


@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing_w2_b", "incomplete LoHa: no hada_w2_b"),
        ("lonely_t1", "incomplete LoHa: hada_t1"),
        ("rank_mismatch", "shape mismatch: LoHa factors do not pair"),
        ("wrong_in", "shape mismatch: LoHa delta input"),
        ("wrong_out", "shape mismatch: adapter has 10 output rows"),
        ("nan", "bad tensor: fc.hada_w1_b holds NaN or Inf"),
    ],
)
def test_bad_parts_are_reported(case, expect):
    model = nn.ModuleDict({"fc": nn.Linear(12, 8)})
    sd = loha_sd("fc", 8, 12, rank=2, seed=12, alpha=1.0)
    if case == "missing_w2_b":
        del sd["fc.hada_w2_b"]
    elif case == "lonely_t1":
        sd["fc.hada_t1"] = torch.randn(2, 2, 3)
    elif case == "rank_mismatch":
        sd["fc.hada_w1_b"] = torch.randn(3, 12)
    elif case == "wrong_in":
        sd = loha_sd("fc", 8, 11, rank=2, seed=12, alpha=1.0)
    elif case == "wrong_out":
        sd = loha_sd("fc", 10, 12, rank=2, seed=12, alpha=1.0)
    elif case == "nan":
        sd["fc.hada_w1_b"][0, 0] = float("nan")
    reasons = _reasons(sd, model)
    assert len(reasons) == 1 and reasons[0].startswith(expect), reasons


def test_report_names_the_dense_runtime_cost():
    """The issue allows a dense runtime path for LoHa as long as the report says what it costs."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 6))
    g = torch.Generator().manual_seed(5)
    sd = {
        f"0.{k}": torch.randn(*s, generator=g)
        for k, s in {
            "hada_w1_a": (6, 2),
            "hada_w1_b": (2, 8),
            "hada_w2_a": (6, 2),
            "hada_w2_b": (2, 8),
        }.items()
    }
    handle = loraweave.apply(model, sd, mode="runtime", strict=True)
    assert "loha: dense" in handle.report.applied[0].cost
    assert "loha: dense" in json.dumps(handle.report.to_dict())
