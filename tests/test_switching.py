"""Switching a live handle between adapter sets: results equal a fresh apply, unchanged layers are not
touched, and in runtime mode no weight tensor is touched at all (data pointers and versions)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.common import gen, rel_err
from helpers.switch_models import LAYERS, _lora
from helpers.tiny_models import flux_forward, tiny_flux

import loraweave
from loraweave.request.spec import AdapterSpec


@pytest.fixture(scope="module")
def setup():
    base = tiny_flux()
    files = {
        "a": _lora(base, LAYERS[:3], 1),
        "b": _lora(base, LAYERS[1:], 2),
        "c": _lora(base, LAYERS[2:], 3),
    }
    return base, files


def _specs(files, strengths: dict[str, float]):
    return [AdapterSpec(files[n], s, name=n) for n, s in strengths.items()]


def _weights_state(model):
    return {n: (p.data_ptr(), p._version, p.detach().clone()) for n, p in model.named_parameters()}


SETS = [{"a": 1.0, "b": 0.5}, {"a": 0.7, "c": 1.2}, {"a": 1.0, "b": 0.5}, {"a": 1.0}, {"b": -0.4}, {}]


@pytest.mark.parametrize("mode", ["runtime", "merge"])
def test_switch_sequence_equals_fresh_apply(setup, mode):
    base, files = setup
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, _specs(files, SETS[0]), mode=mode)
    before = _weights_state(model)
    for strengths in SETS[1:]:
        handle.switch(_specs(files, strengths))
        fresh = copy.deepcopy(base)
        loraweave.apply(fresh, _specs(files, strengths), mode=mode)
        with torch.no_grad():
            if mode == "merge":
                for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
                    assert torch.equal(a, b), (strengths, n)
            else:
                assert rel_err(flux_forward(model), flux_forward(fresh)) <= 1e-6, strengths
                after = _weights_state(model)
                assert all(
                    after[n][:2] == before[n][:2] and torch.equal(after[n][2], before[n][2]) for n in before
                )
    handle.remove()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), base.state_dict().values(), strict=True)
    )


def test_runtime_drop_gates_without_rebuilding(setup):
    base, files = setup
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, _specs(files, {"a": 1.0, "b": 0.5}), mode="runtime")
    handle.switch(_specs(files, {"a": 1.0}))
    assert handle.last_switch == {
        "kept": 3,
        "reattached": 0,
        "rebuilt": 0,
        "dropped": 1,
    }  # b alone on the last layer: detached
    handle.switch(
        _specs(files, {"a": 0.3, "b": 0.5})
    )  # b comes back: gated layers re-open, the last is rebuilt
    assert handle.last_switch == {"kept": 3, "reattached": 1, "rebuilt": 0, "dropped": 0}
    fresh = copy.deepcopy(base)
    loraweave.apply(fresh, _specs(files, {"a": 0.3, "b": 0.5}), mode="runtime")
    with torch.no_grad():
        assert rel_err(flux_forward(model), flux_forward(fresh)) <= 1e-6


def test_merge_switch_leaves_unchanged_layers_alone(setup):
    base, files = setup
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, _specs(files, {"a": 1.0, "b": 0.5}), mode="merge")
    untouched = model.get_submodule(LAYERS[0]).weight  # only `a` lands here, at the same strength below
    version = untouched._version
    handle.switch(_specs(files, {"a": 1.0, "b": 0.9}))
    assert untouched._version == version
    assert handle.last_switch["kept"] == len(LAYERS)


def test_500_layer_runtime_switch_touches_no_weight():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(500)])
    sets = []
    for seed in (1, 2):
        g = gen(seed)
        sets.append(
            {f"{i}.lora_A.weight": torch.randn(2, 16, generator=g) for i in range(0, 500, seed)}
            | {f"{i}.lora_B.weight": torch.randn(16, 2, generator=g) * 0.01 for i in range(0, 500, seed)}
        )
    pristine = copy.deepcopy(model)
    handle = loraweave.apply(model, sets[0], mode="runtime", strict=True)
    state = {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()}
    for sd in (sets[1], sets[0], sets[1]):
        handle.switch(sd)
        assert handle.report.keys_applied == len(sd)
        assert {n: (p.data_ptr(), p._version) for n, p in model.named_parameters()} == state
    loraweave.apply(pristine, sets[1], mode="runtime")
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert torch.equal(model(x), pristine(x))


def test_runtime_switch_back_reattaches_previous_paths(setup):
    base, files = setup
    model = copy.deepcopy(base)
    handle = loraweave.apply(model, _specs(files, {"a": 1.0}), mode="runtime")
    handle.switch(_specs(files, {"c": 1.0}))
    handle.switch(_specs(files, {"a": 0.5}))  # A's paths come back from the previous switch, rebound at 0.5
    assert handle.last_switch["rebuilt"] == 0 and handle.last_switch["reattached"] >= 1
    fresh = copy.deepcopy(base)
    loraweave.apply(fresh, _specs(files, {"a": 0.5}), mode="runtime")
    with torch.no_grad():
        assert rel_err(flux_forward(model), flux_forward(fresh)) <= 1e-6
