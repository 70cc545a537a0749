"""Stack modes, component strengths and block weights through `apply`, on a tiny real Flux.

Reference: per shared layer, each adapter's ΔW built by hand (B·A·alpha/rank), combined by PEFT's own merge
utilities (ties / magnitude_prune; DARE with PEFT drawing the same masks: its global RNG seeded as our masks
are), added to the original weight. Layers one adapter touches get its plain ΔW·strength."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.common import gen, rel_err
from helpers.tiny_models import flux_forward, tiny_flux
from peft.utils import merge_utils as peft_merge

import loraweave
from loraweave.request.spec import AdapterSpec
from loraweave.resolve.stacking import stack_key
from loraweave.stack.combine import mask_seed

SHARED = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.1.ff.net.2",
    "single_transformer_blocks.0.proj_out",
]
ONLY_A = ["transformer_blocks.0.attn.to_k"]
STRENGTHS = {"a": 0.8, "b": -0.6}


def _lora(model, modules, seed: int, rank: int = 4, alpha: float = 2.0) -> dict[str, torch.Tensor]:
    g = gen(seed)
    sd = {}
    for path in modules:
        w = model.get_submodule(path).weight
        sd[f"transformer.{path}.lora_A.weight"] = torch.randn(rank, w.shape[1], generator=g) * 0.3
        sd[f"transformer.{path}.lora_B.weight"] = torch.randn(w.shape[0], rank, generator=g) * 0.3
        sd[f"transformer.{path}.alpha"] = torch.tensor(alpha)
    return sd


def _delta(sd, path, rank: int = 4) -> torch.Tensor:
    scale = float(sd[f"transformer.{path}.alpha"]) / rank
    return scale * sd[f"transformer.{path}.lora_B.weight"] @ sd[f"transformer.{path}.lora_A.weight"]


def _peft_combine(mode, deltas, weights, density, key):
    w = torch.tensor(weights)
    if mode == "ties":
        return peft_merge.ties([d.clone() for d in deltas], w, density)
    if mode == "magnitude_prune":
        return peft_merge.magnitude_prune([d.clone() for d in deltas], w, density)
    torch.manual_seed(mask_seed(key, mode, density))
    fn = peft_merge.dare_ties if mode == "dare_ties" else peft_merge.dare_linear
    return fn([d.clone() for d in deltas], w, density)


@pytest.fixture(scope="module")
def setup():
    base = tiny_flux()
    return base, _lora(base, SHARED + ONLY_A, 1), _lora(base, SHARED, 2)


@pytest.mark.parametrize("mode", ["ties", "dare_ties", "dare_linear", "magnitude_prune"])
def test_stack_modes_merge_equals_peft_combination(setup, mode):
    base, sd_a, sd_b = setup
    model = copy.deepcopy(base)
    specs = [AdapterSpec(sd_a, STRENGTHS["a"], name="a"), AdapterSpec(sd_b, STRENGTHS["b"], name="b")]
    handle = loraweave.apply(model, specs, mode="merge", stack=mode, density=0.5, strict=True)
    for path in SHARED:
        want = _peft_combine(
            mode,
            [_delta(sd_a, path), _delta(sd_b, path)],
            [STRENGTHS["a"], STRENGTHS["b"]],
            0.5,
            stack_key("transformer", path, ["a", "b"]),
        )
        got = model.get_submodule(path).weight - base.get_submodule(path).weight
        assert rel_err(got, want) <= 1e-5, path
    for path in ONLY_A:
        got = model.get_submodule(path).weight - base.get_submodule(path).weight
        assert rel_err(got, STRENGTHS["a"] * _delta(sd_a, path)) <= 1e-5, path
    notes = {m.module: m.notes for m in handle.report.applied}
    assert all(any(f"stack={mode}" in n for n in notes[p]) for p in SHARED)
    handle.remove()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), base.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("mode", ["ties", "dare_linear"])
def test_stack_runtime_matches_merge_and_follows_strength(setup, mode):
    base, sd_a, sd_b = setup
    specs = lambda sa: [AdapterSpec(sd_a, sa, name="a"), AdapterSpec(sd_b, STRENGTHS["b"], name="b")]  # noqa: E731
    merged, runtime = copy.deepcopy(base), copy.deepcopy(base)
    hm = loraweave.apply(merged, specs(STRENGTHS["a"]), mode="merge", stack=mode, density=0.5, strict=True)
    hr = loraweave.apply(runtime, specs(STRENGTHS["a"]), mode="runtime", stack=mode, density=0.5, strict=True)
    with torch.no_grad():
        assert rel_err(flux_forward(runtime), flux_forward(merged)) <= 1e-5
        hm.set_strength("a", 0.3)
        hr.set_strength("a", 0.3)
        fresh = copy.deepcopy(base)
        loraweave.apply(fresh, specs(0.3), mode="merge", stack=mode, density=0.5, strict=True)
        assert all(
            torch.equal(a, b)
            for a, b in zip(merged.state_dict().values(), fresh.state_dict().values(), strict=True)
        )
        assert rel_err(flux_forward(runtime), flux_forward(fresh)) <= 1e-5


def test_same_set_twice_is_bit_identical(setup):
    base, sd_a, sd_b = setup
    results = []
    for _ in range(2):
        model = copy.deepcopy(base)
        loraweave.apply(
            model,
            [AdapterSpec(sd_a, 0.7, name="a"), AdapterSpec(sd_b, 0.9, name="b")],
            mode="merge",
            stack="dare_ties",
            density=0.3,
        )
        results.append(model.state_dict())
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])


def test_bad_stack_settings_are_errors(setup):
    base, sd_a, sd_b = setup
    with pytest.raises(ValueError, match="stack"):
        loraweave.apply(copy.deepcopy(base), [sd_a, sd_b], stack="average")
    with pytest.raises(ValueError, match="density"):
        loraweave.apply(copy.deepcopy(base), [sd_a, sd_b], stack="ties")


def test_block_weights_and_text_encoder_strength():
    from helpers.tiny_clip import _delta as te_delta
    from helpers.tiny_clip import _lora as te_lora
    from helpers.tiny_clip import tiny_clip

    base, clip = tiny_flux(), tiny_clip()
    sd = _lora(
        base,
        [
            "transformer_blocks.0.attn.to_q",
            "transformer_blocks.1.attn.to_q",
            "single_transformer_blocks.1.proj_out",
            "x_embedder",
        ],
        3,
    )
    q = (
        dict(clip.named_modules())["text_model.encoder.layers.0.self_attn.q_proj"]
        if hasattr(clip, "text_model")
        else dict(clip.named_modules())["encoder.layers.0.self_attn.q_proj"]
    )
    te_before = q.weight.detach().clone()
    te_lora(sd, "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", q, 9)
    model = copy.deepcopy(base)
    # Flux slots: BASE, D00.., S00..; this tiny model has 2 double and 2 single blocks.
    weights = {"BASE": 0.5, "D00": 1.0, "D01": 0.0, "S00": 1.0, "S01": 2.0}
    spec = AdapterSpec(sd, 0.8, te_strength=0.25, block_weights=weights, name="a")
    handle = loraweave.apply({"transformer": model, "text_encoder": clip}, spec, mode="merge", strict=True)
    expect = {
        "transformer_blocks.0.attn.to_q": 0.8,
        "transformer_blocks.1.attn.to_q": 0.0,
        "single_transformer_blocks.1.proj_out": 1.6,
        "x_embedder": 0.4,
    }
    for path, s in expect.items():
        got = model.get_submodule(path).weight - base.get_submodule(path).weight
        assert rel_err(got, s * _delta(sd, path)) <= 1e-5 if s else torch.equal(got, torch.zeros_like(got)), (
            path
        )
    # text encoders: their own strength x the BASE weight
    stem = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    assert torch.allclose(q.weight, te_before + 0.25 * 0.5 * te_delta(sd, stem), atol=1e-6)
    handle.set_strength("a", 0.4)  # denoiser strength: block weights stay, the TE keeps its own strength
    got = model.get_submodule("x_embedder").weight - base.get_submodule("x_embedder").weight
    assert rel_err(got, 0.2 * _delta(sd, "x_embedder")) <= 1e-5


def test_block_weights_that_fit_nothing_list_what_would():
    base = tiny_flux()
    sd = _lora(base, ["transformer_blocks.0.attn.to_q"], 3)
    with pytest.raises(ValueError, match="accepted"):
        loraweave.apply(
            copy.deepcopy(base), AdapterSpec(sd, 1.0, block_weights=[1.0, 2.0, 3.0]), mode="merge"
        )


def test_combined_bias_follows_strength_at_runtime(setup):
    """lora_B.bias on a shared layer: summed at the live strengths in runtime mode, as merged."""
    base, sd_a, sd_b = setup
    g = gen(21)
    sd_a, sd_b = dict(sd_a), dict(sd_b)
    for sd in (sd_a, sd_b):
        for path in SHARED:
            rows = base.get_submodule(path).weight.shape[0]
            sd[f"transformer.{path}.lora_B.bias"] = torch.randn(rows, generator=g) * 0.1
    specs = lambda sa: [AdapterSpec(sd_a, sa, name="a"), AdapterSpec(sd_b, STRENGTHS["b"], name="b")]  # noqa: E731
    runtime = copy.deepcopy(base)
    handle = loraweave.apply(
        runtime, specs(STRENGTHS["a"]), mode="runtime", stack="ties", density=0.5, strict=True
    )
    handle.set_strength("a", 0.25)
    fresh = copy.deepcopy(base)
    loraweave.apply(fresh, specs(0.25), mode="merge", stack="ties", density=0.5, strict=True)
    with torch.no_grad():
        assert rel_err(flux_forward(runtime), flux_forward(fresh)) <= 1e-5
