"""Requantize, hosting and the routing rule between them on SDNQ layers; retention ρ and capture in the
report.

Every expected number is computed here from the layer's own tensors (sdnq's dequantizer, the stored scales and
levels) and an exact fp64 SVD, never from loraweave's result."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers.common import gen, rel_err
from helpers.sdnq_models import (
    IN,
    OUT_A,
    X,
    assert_restored,
    float_model,
    layer_outputs,
    lokr,
    lora,
    quantized,
    snapshot,
)

import loraweave

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")
from sdnq.utils import get_sdnq_params  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def dequantized(layer) -> torch.Tensor:
    deq = layer.sdnq_dequantizer
    return deq(
        **get_sdnq_params(layer), skip_quantized_matmul=deq.use_quantized_matmul, dtype=torch.float32
    ).double()


def rho(before: torch.Tensor, after: torch.Tensor, delta: torch.Tensor) -> float:
    return float(((after - before) * delta).sum() / delta.pow(2).sum())


def affine_step(layer) -> float:
    return float(layer.scale.double().abs().mean())


def energies(delta: torch.Tensor) -> torch.Tensor:
    """energies[k-1] = fraction of ‖Δ‖² in the top k singular values (exact, fp64)."""
    s = torch.linalg.svdvals(delta.double())
    return s.pow(2).cumsum(0) / s.pow(2).sum()


def only_a(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if k.startswith("a.")}


@pytest.mark.parametrize("layout, bound", [("uint4", "poor"), ("int8", "kept")])
def test_requantize_retention(layout, bound):
    """One LoRA-scale delta (rms = 0.035 uint4 steps, the notes' typical case): uint4 (group 64) erases it
    (upstream law: ρ < 4·2/group), int8 keeps most of it (ρ > 0.5)."""
    model = quantized(float_model(), layout)
    sd, delta = lora("a", OUT_A, 8, 40)
    uint4_step = affine_step(quantized(float_model(), "uint4").a)
    strength = 0.035 * uint4_step / float(delta.pow(2).mean().sqrt())
    before, snap = dequantized(model.a), snapshot(model)
    handle = loraweave.apply(model, (sd, strength), mode="merge", quantized="requantize", strict=True)
    entry = handle.report.applied[0]
    assert entry.mechanism == "requantize" and entry.backend == "sdnq"
    expected = rho(before, dequantized(model.a), strength * delta)
    assert abs(entry.retention - expected) <= 1e-6
    if bound == "poor":
        assert expected < 4 * 2 / 64, expected
    else:
        assert expected > 0.5, expected
    assert (
        type(model.a).__name__ == "SDNQLinear" and model.a.original_class is torch.nn.Linear
    )  # never re-wrapped
    handle.remove()
    assert_restored(model, snap)


def test_hosted_low_rank_delta_rides_whole():
    """A LoHa with rank-2 halves has rank <= 4: hosting captures all of it and the output change is exact."""
    model = quantized(float_model(), "uint4")
    g = gen(41)
    t = {
        k: torch.randn(*s, generator=g) * 0.1
        for k, s in {
            "hada_w1_a": (OUT_A, 2),
            "hada_w1_b": (2, IN),
            "hada_w2_a": (OUT_A, 2),
            "hada_w2_b": (2, IN),
        }.items()
    }
    sd = {f"a.{k}": v for k, v in t.items()} | {"a.alpha": torch.tensor(2.0)}
    delta = (t["hada_w1_a"] @ t["hada_w1_b"]).double() * (t["hada_w2_a"] @ t["hada_w2_b"]).double()
    before, snap = layer_outputs(model, X), snapshot(model)
    handle = loraweave.apply(model, sd, mode="auto", quantized="host", strict=True)
    entry = handle.report.applied[0]
    assert entry.mechanism == "hosted" and entry.rank <= 4
    assert entry.capture >= 1 - 1e-6 and abs(entry.retention - 1) <= 1e-5
    assert not model.a._forward_hooks and "forward" not in model.a.__dict__  # hook-free
    assert rel_err(layer_outputs(model, X)["a"] - before["a"], X.double() @ delta.t()) <= 1e-4
    handle.remove()
    assert_restored(model, snap)


def test_hosted_random_lokr_reports_its_capture_and_keeps_the_callers_rng():
    model = quantized(float_model(), "uint4")
    g = gen(42)
    w1, w2 = torch.randn(16, 16, generator=g) * 0.02, torch.randn(16, 16, generator=g) * 0.02
    sd = {"a.lokr_w1": w1, "a.lokr_w2": w2}
    delta = torch.kron(w1.double(), w2.double())
    rank = 32
    expected_capture = float(energies(delta)[rank - 1])
    before = dequantized(model.a)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    handle = loraweave.apply(model, sd, mode="merge", host_rank=rank, strict=True)
    assert torch.equal(torch.get_rng_state(), rng), "hosting drew from the caller's RNG"
    entry = handle.report.applied[0]
    assert entry.mechanism == "hosted" and entry.rank == rank
    assert abs(entry.capture - expected_capture) <= 1e-4, (entry.capture, expected_capture)
    applied_rho = rho(before, dequantized(model.a), delta)
    assert abs(entry.retention - applied_rho) <= 1e-5 and abs(applied_rho - expected_capture) <= 1e-4
    first = (model.a.svd_up.clone(), model.a.svd_down.clone())
    handle.remove()
    again = loraweave.apply(
        model, sd, mode="merge", host_rank=rank, strict=True
    )  # deterministic: same factors
    assert torch.equal(model.a.svd_up, first[0]) and torch.equal(model.a.svd_down, first[1])
    again.remove()


def routing_case(layout: str, ratio: float, host_rank: int, extra: dict | None = None):
    model = quantized(float_model(), layout)
    sd, delta = lokr("a", OUT_A, 43, scale=0.3)
    sd = only_a(sd)
    strength = ratio * affine_step(model.a) / float(delta.pow(2).mean().sqrt())
    adapters = [(sd, strength)] + ([extra] if extra else [])
    handle = loraweave.apply(model, adapters, mode="merge", host_rank=host_rank, strict=True)
    entry = handle.report.applied[0]
    handle.remove()
    return entry


def threshold_ranks() -> tuple[int, int]:
    """(k with capture clearly < 0.90, k with capture clearly >= 0.90) for the routing LoKr."""
    _, delta = lokr("a", OUT_A, 43, scale=0.3)
    e = energies(delta)
    k_lo = int((e < 0.88).sum())  # e[k_lo-1] < 0.88
    k_hi = int((e < 0.92).sum()) + 1  # e[k_hi-1] >= 0.92
    assert e[k_lo - 1] < 0.88 and e[k_hi - 1] >= 0.92
    return k_lo, k_hi


def test_routing_rule_on_both_sides_of_each_threshold():
    k_lo, k_hi = threshold_ranks()
    fat_lossy = routing_case("uint4", 0.35, k_lo)
    assert fat_lossy.mechanism == "requantize", fat_lossy.why
    assert routing_case("uint4", 0.25, k_lo).mechanism == "hosted"  # thin delta: the grid would erase it
    assert routing_case("uint4", 0.35, k_hi).mechanism == "hosted"  # hosting keeps >= 0.90
    assert routing_case("uint4", 0.25, k_hi).mechanism == "hosted"
    assert routing_case("int8", 0.25, k_hi).mechanism == "requantize"  # 8-bit grids always requantize
    assert routing_case("uint4", 0.35, 0).mechanism == "requantize"  # host_rank 0 keeps requantize
    # Factorable members or a checkpoint SVD on the layer: host, whatever the ratio.
    lora_sd, _ = lora("a", OUT_A, 4, 44)
    assert routing_case("uint4", 0.35, k_lo, extra=only_a(lora_sd)).mechanism == "hosted"
    assert routing_case("uint4_svd", 0.35, k_lo).mechanism == "hosted"


def test_codebook_grid_step_is_the_gap_between_levels():
    from loraweave.quant.sdnq import BACKEND

    model = quantized(float_model(), "uint4_codebook")
    levels = model.a.scale.double().reshape(-1, model.a.scale.shape[-1])
    gap = float(levels.sort(dim=-1).values.diff(dim=-1).mean())
    assert abs(BACKEND.grid_step(model.a) - gap) <= 1e-6 * gap
    assert (
        abs(BACKEND.grid_step(model.a) - float(levels.mean())) > 10 * gap or float(levels.mean()) < 0.1 * gap
    )
    # Affine layers: the step is the scale itself.
    affine = quantized(float_model(), "uint4")
    assert abs(BACKEND.grid_step(affine.a) - affine_step(affine.a)) <= 1e-6 * affine_step(affine.a)


@pytest.mark.parametrize("quantized_opt, mechanism", [("requantize", "requantize"), ("host", "hosted")])
def test_set_strength_rewrites_from_the_originals(quantized_opt, mechanism):
    model = quantized(float_model(), "uint4")
    sd, delta = lokr("a", OUT_A, 45, scale=0.2)
    sd = only_a(sd)
    snap = snapshot(model)
    handle = loraweave.apply(model, sd, mode="merge", quantized=quantized_opt, host_rank=64, strict=True)
    assert handle.report.applied[0].mechanism == mechanism
    stored = {k: None if v is None else v.clone() for k, v in get_sdnq_params(model.a).items()}
    name = handle.report.adapters[0]["name"]
    for s in (0.3, -1.7, 1.0):
        handle.set_strength(name, s)
    for k, v in get_sdnq_params(model.a).items():  # no compounding: the same tensors as the first write
        assert (v is None and stored[k] is None) or torch.equal(v, stored[k]), k
    handle.set_strength(name, 0.5)
    assert handle.report.applied[0].retention is not None
    handle.remove()
    assert_restored(model, snap)


def test_one_log_line_per_mechanism(caplog):
    model = quantized(float_model(), "uint4")
    sd_a, _ = lokr("a", OUT_A, 46, scale=0.02)
    sd_b, _ = lora("b", 384, 8, 47)
    with caplog.at_level(logging.INFO, logger="loraweave"):
        handle = loraweave.apply(model, [only_a(sd_a), sd_b], mode="merge", host_rank=16, strict=True)
    lines = [r.getMessage() for r in caplog.records if "apply=" in r.getMessage()]
    assert sorted(line.split()[1] for line in lines) == ["apply=factor", "apply=hosted"], lines
    hosted = next(line for line in lines if "apply=hosted" in line)
    for field in (
        "layers=1",
        "rank_max=16",
        "capture_median=",
        "capture_min=",
        "retention_median=",
        "retention_min=",
    ):
        assert field in hosted, hosted
    mech = handle.report.to_dict()["mechanisms"]
    assert mech["hosted"]["retention_min"] == handle.report.applied[0].retention
    handle.remove()
