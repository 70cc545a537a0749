"""Step windows and ramps (AdapterSpec.steps / ramp) through a real diffusers FluxPipeline's
callback_on_step_end: a 6-step run equals one in which the adapter is applied by hand (a fresh runtime apply,
removed again) on exactly the window's steps; no weight tensor is touched and no factor or scale tensor is
reallocated."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.persample_adapters import adapter
from helpers.tiny_models import tiny_flux

import loraweave
from loraweave.errors import ArgumentError
from loraweave.resolve.schedule import StepWindow

STEPS = 6


def pipeline(transformer):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )


def generate(pipe, callback) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return pipe(
        prompt_embeds=torch.randn(1, 5, 32, generator=g),
        pooled_prompt_embeds=torch.randn(1, 32, generator=g),
        height=64,
        width=64,
        num_inference_steps=STEPS,
        output_type="latent",
        generator=torch.Generator().manual_seed(1),
        callback_on_step_end=callback,
    ).images


def by_hand(base, ads: dict[str, dict], plan: dict[str, list[float]]) -> torch.Tensor:
    """Each step's adapters applied at that step's strengths before it, removed after it: no schedule code."""
    model = copy.deepcopy(base)
    pipe = pipeline(model)
    live = []

    def put(step: int) -> None:
        while live:
            live.pop().remove()
        specs = [
            loraweave.AdapterSpec(ads[n], strength=v[step], name=n) for n, v in plan.items() if v[step] != 0.0
        ]
        if specs:
            live.append(loraweave.apply(model, specs, mode="runtime"))

    put(0)

    def callback(p, step, t, kwargs):
        put(min(step + 1, STEPS - 1))
        return kwargs

    out = generate(pipe, callback)
    while live:
        live.pop().remove()
    return out


def test_window_and_ramp_equal_applying_by_hand_on_those_steps():
    base = tiny_flux()
    ads = {"turbo": adapter(base, "lora", 1), "detail": adapter(base, "lokr", 2)}
    specs = [
        loraweave.AdapterSpec(ads["turbo"], strength=0.8, name="turbo", steps=(0.0, 0.5)),
        loraweave.AdapterSpec(
            ads["detail"], name="detail", steps=(0.5, 1.0), ramp="linear", ramp_strengths=(1.0, 0.2)
        ),
    ]
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, specs, mode="runtime", strict=True)
    weights = {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()}
    kept = [
        (rp.scale.data_ptr(), rp.down.data_ptr() if rp.down is not None else 0) for rp in handle.runtime_paths
    ]
    schedule = handle.step_schedule(STEPS)
    want = {"turbo": [0.8, 0.8, 0.8, 0.0, 0.0, 0.0], "detail": [0.0, 0.0, 0.0, 1.0, 0.6, 0.2]}
    assert all(schedule.table[n] == pytest.approx(v) for n, v in want.items())
    got = generate(pipeline(model), schedule)
    ref = by_hand(base, ads, want)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err <= 1e-5, err
    assert {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()} == weights
    assert [
        (rp.scale.data_ptr(), rp.down.data_ptr() if rp.down is not None else 0) for rp in handle.runtime_paths
    ] == kept
    assert handle.strengths == {"turbo": 0.8, "detail": 1.0}  # restored after the last step
    # negative controls: the window shifted by one step, or no window at all, give other results
    shifted = by_hand(base, ads, {"turbo": [0.8, 0.8, 0.0, 0.0, 0.0, 0.0], "detail": want["detail"]})
    always = by_hand(base, ads, {"turbo": [0.8] * 6, "detail": [1.0] * 6})
    assert float((got - shifted).abs().max() / ref.abs().max()) > 1e-3
    assert float((got - always).abs().max() / ref.abs().max()) > 1e-3
    handle.remove()


def test_window_rule_and_validation():
    assert StepWindow(0.0, 0.3).strengths(1.0, 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert StepWindow(2 / 3, 1.0).strengths(0.5, 6) == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    assert StepWindow(0.0, 1.0, (0.0, 1.0)).strengths(9.0, 5) == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    for bad, message in [
        ({"steps": (0.5, 0.5)}, "start < end"),
        ({"steps": (-0.1, 0.5)}, "start < end"),
        ({"steps": (0, float("nan"))}, "finite"),
        ({"steps": 0.5}, "pair"),
        ({"ramp": "cosine", "ramp_strengths": (0, 1)}, "one of"),
        ({"ramp": "linear"}, "needs ramp_strengths"),
        ({"ramp_strengths": (0, 1)}, "needs ramp='linear'"),
    ]:
        with pytest.raises(ArgumentError, match=message):
            loraweave.AdapterSpec({}, **bad)


def test_schedule_refusals():
    base = tiny_flux()
    sd = adapter(base, "lora", 1)
    handle = loraweave.apply(copy.deepcopy(base), [loraweave.AdapterSpec(sd, name="a")], mode="runtime")
    with pytest.raises(ValueError, match="no adapter has a step window"):
        handle.step_schedule(6)
    merged = loraweave.apply(
        copy.deepcopy(base), [loraweave.AdapterSpec(sd, name="a", steps=(0, 0.5))], mode="merge"
    )
    with pytest.raises(ValueError, match="merged"):
        merged.step_schedule(6)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ArgumentError, match="total_steps"):
            merged.step_schedule(bad)
