"""Stack modes: equality with PEFT's merge utilities, an independent reference per mode, determinism."""

from __future__ import annotations

import pytest
import torch
from peft.utils import merge_utils as peft_merge

from loraweave.stack import STACK_MODES, combine_deltas, dare_masks, mask_seed

SHAPE = (48, 40)
WEIGHTS = [0.8, -0.6, 1.3]


def _deltas(seed: int = 0, n: int = 3, shape=SHAPE) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(n)]


# --- independent references, written here from the published definitions -------------------------------


def _ref_trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the int(density·n) largest magnitudes: threshold at the k-th largest |value| (no ties in
    randn)."""
    k = int(density * delta.numel())
    if density >= 1:
        return delta.clone()
    out = torch.zeros_like(delta)
    if k == 0:
        return out
    thresh = delta.abs().flatten().sort(descending=True).values[k - 1]
    keep = delta.abs() >= thresh
    out[keep] = delta[keep]
    return out


def _ref_ties(pruned: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Elect the sign of the summed (unweighted) pruned deltas, mean of the weighted agreeing entries."""
    out = torch.zeros_like(pruned[0])
    rows, cols = out.shape
    for i in range(rows):
        for j in range(cols):
            vals = [float(p[i, j]) for p in pruned]
            sign = 1.0 if sum(vals) >= 0 else -1.0
            agree = [w * v for v, w in zip(vals, weights, strict=True) if v != 0 and (v > 0) == (sign > 0)]
            out[i, j] = sum(agree) / len(agree) if agree else 0.0
    return out


def _ref_dare(deltas, masks, density):
    return [d * m / density for d, m in zip(deltas, masks, strict=True)]


# --- PEFT equality --------------------------------------------------------------------------------------


@pytest.mark.parametrize("density", [0.2, 0.5, 1.0])
def test_ties_and_magnitude_prune_equal_peft(density):
    deltas = _deltas(1)
    w = torch.tensor(WEIGHTS)
    ours = combine_deltas(deltas, WEIGHTS, "ties", density, "layer")
    theirs = peft_merge.ties([d.clone() for d in deltas], w, density)
    assert torch.equal(ours, theirs)
    ours = combine_deltas(deltas, WEIGHTS, "magnitude_prune", density, "layer")
    theirs = peft_merge.magnitude_prune([d.clone() for d in deltas], w, density)
    assert torch.equal(ours, theirs)


def test_sum_equals_peft_task_arithmetic():
    deltas = _deltas(2)
    ours = combine_deltas(deltas, WEIGHTS, "sum", None, "layer")
    # sum accumulates in place (no stacked copy), so rounding order differs from PEFT's stack-and-sum
    theirs = peft_merge.task_arithmetic(deltas, torch.tensor(WEIGHTS))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ref = WEIGHTS[0] * deltas[0] + WEIGHTS[1] * deltas[1] + WEIGHTS[2] * deltas[2]
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["dare_linear", "dare_ties"])
@pytest.mark.parametrize("density", [0.3, 0.7])
def test_dare_equal_peft_on_same_stream(mode, density):
    # Fair comparison: PEFT draws its masks from the global RNG, one bernoulli(full(p)) per adapter in order.
    # Seeding the global RNG with our per-layer seed makes PEFT draw the very stream our local generator
    # draws, so equality checks the whole pipeline (masks, rescale, sign election, disjoint mean).
    deltas = _deltas(3)
    key = "unet.down_blocks.0.attn1.to_q|a.safetensors|b.safetensors|c.safetensors"
    ours = combine_deltas(deltas, WEIGHTS, mode, density, key)
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(mask_seed(key, mode, density))
        theirs = getattr(peft_merge, mode)([d.clone() for d in deltas], torch.tensor(WEIGHTS), density)
    finally:
        torch.set_rng_state(saved)
    assert torch.equal(ours, theirs)


# --- independent references ----------------------------------------------------------------------------


@pytest.mark.parametrize("density", [0.25, 0.6, 1.0])
def test_ties_matches_independent_reference(density):
    deltas = _deltas(4, shape=(12, 10))
    ours = combine_deltas(deltas, WEIGHTS, "ties", density, "k")
    ref = _ref_ties([_ref_trim(d, density) for d in deltas], WEIGHTS)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_magnitude_prune_matches_independent_reference():
    deltas = _deltas(5)
    ours = combine_deltas(deltas, WEIGHTS, "magnitude_prune", 0.35, "k")
    ref = sum(w * _ref_trim(d, 0.35) for d, w in zip(deltas, WEIGHTS, strict=True))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    # exactly int(0.35·n) entries survive per adapter
    for d in deltas:
        assert int((_ref_trim(d, 0.35) != 0).sum()) == int(0.35 * d.numel())


def test_dare_matches_independent_reference_and_keep_rate():
    deltas = _deltas(6, shape=(200, 150))
    density = 0.3
    masks = dare_masks((200, 150), 3, density, "layer-x", "dare_linear")
    for m in masks:
        assert set(m.unique().tolist()) <= {0.0, 1.0}
        # 30000 Bernoulli(0.3) draws: std of the rate ≈ 0.0026; 0.015 is > 5 sigma
        assert abs(float(m.mean()) - density) < 0.015
    assert not torch.equal(masks[0], masks[1])  # each adapter gets its own mask
    ours = combine_deltas(deltas, WEIGHTS, "dare_linear", density, "layer-x")
    ref = sum(w * p for w, p in zip(WEIGHTS, _ref_dare(deltas, masks, density), strict=True))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    # DARE preserves the expectation: the mean over many keys approaches the plain sum
    acc = torch.zeros(200, 150)
    small = [d[:20, :20] for d in deltas]
    for i in range(400):
        acc[:20, :20] += combine_deltas(small, WEIGHTS, "dare_linear", 0.5, f"k{i}")
    plain = combine_deltas(small, WEIGHTS, "sum", None, "k")
    # per-entry std of one draw ≤ sqrt(Σ w²d²); averaged over 400 draws → /20; check the mean abs error
    assert float((acc[:20, :20] / 400 - plain).abs().mean()) < 0.1 * float(plain.abs().mean())


def test_dare_ties_matches_independent_reference():
    deltas = _deltas(7, shape=(10, 9))
    density = 0.5
    masks = dare_masks((10, 9), 3, density, "kk", "dare_ties")
    ours = combine_deltas(deltas, WEIGHTS, "dare_ties", density, "kk")
    torch.testing.assert_close(
        ours, _ref_ties(_ref_dare(deltas, masks, density), WEIGHTS), rtol=1e-6, atol=1e-6
    )


# --- determinism and RNG hygiene -----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["dare_linear", "dare_ties", "ties", "magnitude_prune", "sum"])
def test_bit_identical_reapply_and_global_rng_untouched(mode):
    deltas = _deltas(8)
    density = None if mode == "sum" else 0.4
    torch.manual_seed(1234)
    before = torch.get_rng_state().clone()
    a = combine_deltas(deltas, WEIGHTS, mode, density, "L|a|b|c")
    b = combine_deltas(deltas, WEIGHTS, mode, density, "L|a|b|c")
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a, b)


def test_masks_depend_on_key_mode_density():
    base = dare_masks((64, 64), 1, 0.5, "L1", "dare_linear")[0]
    assert torch.equal(base, dare_masks((64, 64), 1, 0.5, "L1", "dare_linear")[0])
    assert not torch.equal(base, dare_masks((64, 64), 1, 0.5, "L2", "dare_linear")[0])
    assert not torch.equal(base, dare_masks((64, 64), 1, 0.5, "L1", "dare_ties")[0])
    assert not torch.equal(base, dare_masks((64, 64), 1, 0.5000001, "L1", "dare_linear")[0])


def test_select_modes_return_the_chosen_adapter():
    d = _deltas(9, n=2)
    out = combine_deltas(d, [0.7, 1.2], "klora", None, "k", choice=1)
    assert torch.equal(out, d[1] * 1.2)
    with pytest.raises(ValueError, match="choice"):
        combine_deltas(d, [0.7, 1.2], "estlora", None, "k")
    with pytest.raises(ValueError, match="exactly two"):
        combine_deltas(_deltas(9, n=3), WEIGHTS, "klora", None, "k", choice=0)


@pytest.mark.parametrize(
    "mode,density,match",
    [
        ("median", None, "unknown stack mode"),
        ("ties", None, "needs density"),
        ("dare_linear", 0.0, r"\(0, 1\]"),
        ("dare_ties", 1.5, r"\(0, 1\]"),
        ("magnitude_prune", -0.1, r"\(0, 1\]"),
        ("ties", float("nan"), "finite"),
        ("sum", 0.5, "only applies"),
        ("klora", 0.5, "only applies"),
    ],
)
def test_invalid_mode_or_density(mode, density, match):
    with pytest.raises(ValueError, match=match):
        combine_deltas(_deltas(0, n=2), [1.0, 1.0], mode, density, "k", choice=0)


def test_shape_and_weight_mismatch():
    d = _deltas(0, n=2)
    with pytest.raises(ValueError, match="shape"):
        combine_deltas([d[0], d[1][:4]], [1.0, 1.0], "sum", None, "k")
    with pytest.raises(ValueError, match="weights"):
        combine_deltas(d, [1.0], "sum", None, "k")


def test_modes_constant():
    assert STACK_MODES == ("sum", "ties", "dare_ties", "dare_linear", "magnitude_prune", "klora", "estlora")


def test_magnitude_prune_ties_and_zero_rows():
    # zero rows (an adapter that touches only part of a fused layer) with density above the nonzero share:
    # PEFT's topk keeps some zeros, the threshold keeps others; the values must still be identical
    d = _deltas(11, n=2)
    d[0][: SHAPE[0] // 2] = 0
    w = torch.tensor([1.0, 0.5])
    for mode in ("ties", "magnitude_prune"):
        ours = combine_deltas(d, [1.0, 0.5], mode, 0.8, "k")
        assert torch.equal(ours, getattr(peft_merge, mode)([x.clone() for x in d], w, 0.8))
    # equal magnitudes at the threshold: exactly int(density·n) entries survive, larger ones always do
    tied = torch.tensor([[3.0, -1.0, 1.0, 1.0], [-1.0, 2.0, 1.0, 0.5]])
    out = combine_deltas([tied], [1.0], "magnitude_prune", 0.5, "k")  # k = 4: 3, 2 and two of the five ±1s
    assert int((out != 0).sum()) == 4 and out[0, 0] == 3.0 and out[1, 1] == 2.0
    assert set(out[out != 0].abs().tolist()) == {3.0, 2.0, 1.0}
