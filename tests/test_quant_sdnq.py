"""SDNQ layers through loraweave.apply: runtime and auto exact for LoRA, LoKr and LoHa; the factor channel
exact in every side-channel layout; removal bit-exact; set_strength rewrites from the originals.

References are written here: the float layer's change under the same adapter is x·ΔWᵀ with ΔW built in fp64
from the adapter tensors (γ = alpha/rank), independent of loraweave's families."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.common import gen, rel_err
from torch import nn

import loraweave

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
from helpers.sdnq_models import (
    IN,
    LAYOUTS,
    OUT_A,
    OUT_B,
    X,
    assert_restored,
    float_model,
    layer_outputs,
    lokr,
    lora,
    quantized,
    snapshot,
)
from sdnq.utils import get_sdnq_params  # noqa: E402

RUNTIME_TOL = 1e-4  # acceptance: the layer's output change vs the float layer's change
FACTOR_TOL = 1e-5  # acceptance: the factor channel, every layout (checked on the dequantized weight)
# Output-level checks subtract two fp32 outputs: cancellation costs ~eps32·|y|/|Δy| (1.3e-5 seen on AVX-less
# hosts).
FACTOR_OUT_TOL = 5e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def loha(name: str, out: int, seed: int, rank: int = 4, scale: float = 0.1) -> tuple[dict, torch.Tensor]:
    g = gen(seed)
    t = {
        k: torch.randn(*s, generator=g) * scale
        for k, s in {
            "hada_w1_a": (out, rank),
            "hada_w1_b": (rank, IN),
            "hada_w2_a": (out, rank),
            "hada_w2_b": (rank, IN),
        }.items()
    }
    sd = {f"{name}.{k}": v for k, v in t.items()} | {f"{name}.alpha": torch.tensor(float(rank))}
    d = (
        t["hada_w1_a"].double()
        @ t["hada_w1_b"].double()
        * (t["hada_w2_a"].double() @ t["hada_w2_b"].double())
    )
    return sd, d


def adapter(family: str) -> tuple[dict, dict[str, torch.Tensor]]:
    make = {"lora": lambda n, o, s: lora(n, o, 8, s), "lokr": lokr, "loha": loha}[family]
    (sa, da), (sb, db) = make("a", OUT_A, 10), make("b", OUT_B, 11)
    return sa | sb, {"a": da, "b": db}


@pytest.mark.parametrize("layout", ["int8", "uint4", "uint4_hadamard_qmatmul", "uint4_svd", "uint4_codebook"])
@pytest.mark.parametrize("family", ["lora", "lokr", "loha"])
@pytest.mark.parametrize("mode", ["auto", "runtime"])
def test_output_change_matches_the_float_layer(layout, family, mode):
    model = quantized(float_model(), layout)
    sd, deltas = adapter(family)
    before, snap = layer_outputs(model, X), snapshot(model)
    handle = loraweave.apply(model, sd, mode=mode, strict=True)
    after = layer_outputs(model, X)
    for name, delta in deltas.items():
        assert rel_err(after[name] - before[name], X.double() @ delta.t()) <= RUNTIME_TOL, (
            name,
            layout,
            family,
            mode,
        )
    expect = "factor" if (mode == "auto" and family == "lora") else "runtime"
    assert {(m.module, m.mechanism, m.backend) for m in handle.report.applied} == {
        ("a", expect, "sdnq"),
        ("b", expect, "sdnq"),
    }
    handle.remove()
    assert_restored(model, snap)
    final = layer_outputs(model, X)
    assert all(torch.equal(final[n], before[n]) for n in before)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_factor_channel_is_exact_in_every_layout(layout):
    from loraweave.quant.sdnq import BACKEND

    model = quantized(float_model(), layout)
    (s1, d1), (s2, d2) = lora("a", OUT_A, 8, 20), lora("a", OUT_A, 4, 21)
    before, snap = layer_outputs(model, X), snapshot(model)
    w_before = BACKEND.dequantize(model.a).double()
    handle = loraweave.apply(model, [(s1, 1.0), (s2, -0.7)], mode="auto", strict=True)
    assert [m.mechanism for m in handle.report.applied] == ["factor"]
    assert handle.report.applied[0].retention == 1.0 and handle.report.applied[0].rank == 12
    delta = d1 - 0.7 * d2
    w_after = BACKEND.dequantize(model.a).double()
    assert float((w_after - w_before - delta).norm() / delta.norm()) <= FACTOR_TOL, layout
    after = layer_outputs(model, X)
    assert rel_err(after["a"] - before["a"], X.double() @ delta.t()) <= FACTOR_OUT_TOL, layout
    assert torch.equal(after["b"], before["b"])
    # No weight backup and no hook: only the side channel grew.
    assert not model.a._forward_hooks and "forward" not in model.a.__dict__
    assert model.a.weight is snap["a"][2]["weight"][0]
    # Strength changes rewrite from the original side channel.
    names = [a["name"] for a in handle.report.adapters]
    handle.set_strength(names[1], 0.25)
    delta = d1 + 0.25 * d2
    after = layer_outputs(model, X)
    assert rel_err(after["a"] - before["a"], X.double() @ delta.t()) <= FACTOR_OUT_TOL, layout
    handle.remove()
    assert_restored(model, snap)
    assert torch.equal(layer_outputs(model, X)["a"], before["a"])


def test_factor_channel_layout_shapes():
    """Plain layout: svd_up (out, r), svd_down (r, in); quantized matmul: transposed; Hadamard: down stored as
    A·H."""
    from sdnq.quant_utils import get_hadamard

    sd, delta = lora("a", OUT_A, 8, 30)
    down, up = sd["a.lora_down.weight"], sd["a.lora_up.weight"] * 0.5  # γ = alpha/rank = 0.5
    for layout, transposed, hadamard in (
        ("uint4", False, False),
        ("int8_qmatmul", True, False),
        ("uint4_hadamard", False, True),
    ):
        model = quantized(float_model(), layout)
        with loraweave.apply(model, sd, strict=True):
            su, sdown = model.a.svd_up, model.a.svd_down
            if transposed:
                su, sdown = su.t(), sdown.t()
            assert su.shape == (OUT_A, 8) and sdown.shape == (8, IN), layout
            want = down
            if hadamard:
                n = model.a.sdnq_dequantizer.hadamard_group_size
                want = (down.unflatten(-1, (-1, n)) @ get_hadamard(n)).flatten(-2)
            assert rel_err(sdown, want) <= 1e-6 and rel_err(su, up) <= 1e-6, layout
        assert model.a.svd_up is None and model.a.svd_down is None


def test_checkpoint_svd_is_kept_and_extended():
    model = quantized(float_model(), "uint4_svd")
    orig_up, orig_down = model.a.svd_up, model.a.svd_down
    sd, _ = lora("a", OUT_A, 8, 31)
    with loraweave.apply(model, sd, strict=True):
        assert model.a.svd_up.shape == (OUT_A, 16 + 8)
        assert torch.equal(model.a.svd_up[:, :16], orig_up) and torch.equal(model.a.svd_down[:16], orig_down)
        assert isinstance(model.a.svd_up, nn.Parameter)  # stays where sdnq keeps it (state_dict sees it)
    assert model.a.svd_up is orig_up and model.a.svd_down is orig_down


def test_rank_is_padded_to_a_bucket_without_changing_the_product():
    model = quantized(float_model(), "uint4")
    sd, delta = lora("a", OUT_A, 5, 32)
    before = layer_outputs(model, X)["a"]
    with loraweave.apply(model, sd, strict=True) as handle:
        assert model.a.svd_up.shape == (OUT_A, 8) and handle.report.applied[0].rank == 5
        assert torch.count_nonzero(model.a.svd_up[:, 5:]) == 0
        assert rel_err(layer_outputs(model, X)["a"] - before, X.double() @ delta.t()) <= FACTOR_OUT_TOL


def test_non_factorable_parts_and_bias_deltas_take_the_runtime_path_in_auto():
    model = quantized(float_model(), "uint4")
    g = gen(33)
    down, up, bias = (
        torch.randn(4, IN, generator=g) * 0.05,
        torch.randn(OUT_A, 4, generator=g) * 0.05,
        torch.randn(OUT_A, generator=g) * 0.01,
    )
    peft = {
        "a.lora_A.weight": down,
        "a.lora_B.weight": up,
        "a.lora_B.bias": bias,
    }  # PEFT layout, no alpha: γ = 1
    sd_k, dk = lokr("a", OUT_A, 34)
    sd_b, db = lora("b", OUT_B, 8, 35)
    before = layer_outputs(model, X)
    handle = loraweave.apply(model, [peft, sd_k, sd_b], strict=True)
    mech = {m.module: (m.mechanism, m.why) for m in handle.report.applied}
    assert mech["a"][0] == "runtime" and "lokr" in mech["a"][1], mech
    assert mech["b"][0] == "factor"
    after = layer_outputs(model, X)
    ref_a = X.double() @ (up.double() @ down.double() + dk).t() + bias.double()
    assert rel_err(after["a"] - before["a"], ref_a) <= RUNTIME_TOL
    assert rel_err(after["b"] - before["b"], X.double() @ db.t()) <= RUNTIME_TOL
    handle.remove()


@pytest.mark.parametrize("layout", ["int8", "uint4_hadamard"])
def test_dora_reads_the_dequantized_weight(layout):
    """DoRA's norm needs W: on a quantized layer it is the backend's dequantized weight (the layer's own W),
    never the packed storage. Reference: W' = m·(W + γBA)/‖W + γBA‖ (row norms), with W dequantized here."""
    model = quantized(float_model(), layout)
    g = gen(36)
    down, up = torch.randn(4, IN, generator=g) * 0.05, torch.randn(OUT_A, 4, generator=g) * 0.05
    m = torch.rand(OUT_A, 1, generator=g) + 0.5
    sd = {"a.lora_down.weight": down, "a.lora_up.weight": up, "a.alpha": torch.tensor(2.0), "a.dora_scale": m}
    deq = model.a.sdnq_dequantizer
    w = deq(
        **get_sdnq_params(model.a), skip_quantized_matmul=deq.use_quantized_matmul, dtype=torch.float32
    ).double()
    wc = w + 0.5 * up.double() @ down.double()
    ref = X.double() @ (m.double() * wc / wc.norm(dim=1, keepdim=True) - w).t()
    before, snap = layer_outputs(model, X), snapshot(model)
    handle = loraweave.apply(model, sd, mode="auto", strict=True)
    assert [e.mechanism for e in handle.report.applied] == ["runtime"]
    assert rel_err(layer_outputs(model, X)["a"] - before["a"], ref) <= RUNTIME_TOL
    handle.remove()
    assert_restored(model, snap)


def test_two_handles_on_one_layer_undo_in_reverse_only():
    model = quantized(float_model(), "uint4")
    (s1, _), (s2, _) = lora("a", OUT_A, 8, 36), lora("a", OUT_A, 8, 37)
    snap = snapshot(model)
    h1 = loraweave.apply(model, s1, strict=True)
    h2 = loraweave.apply(model, s2, strict=True)
    with pytest.raises(RuntimeError, match="remove that handle first"):
        h1.remove()
    h2.remove()
    h1.remove()
    assert_restored(model, snap)
