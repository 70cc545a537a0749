"""Select modes through apply: on layers both adapters touch, exactly the scheduled adapter runs at each
step."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.common import rel_err
from helpers.switch_models import LAYERS, _lora
from helpers.tiny_models import flux_forward, tiny_flux

import loraweave
from loraweave.request.spec import AdapterSpec

STEPS = 8


def _only(sd: dict, layers) -> dict:
    return {k: v for k, v in sd.items() if any(f".{layer}." in k for layer in layers)}


@pytest.mark.parametrize("mode", ["klora", "estlora"])
def test_each_step_runs_the_scheduled_adapter(mode):
    base = tiny_flux()
    subject, style = _lora(base, LAYERS[:3], 1), _lora(base, LAYERS[1:], 2)
    model = copy.deepcopy(base)
    handle = loraweave.apply(
        model, [AdapterSpec(subject, 1.0, name="subject"), AdapterSpec(style, 2.0, name="style")], stack=mode
    )
    assert handle.report.mode == "runtime"
    schedule = handle.select_schedule(STEPS)
    schedule.prime(handle)
    callback = schedule.diffusers_callback(handle)
    shared = LAYERS[1:3]
    history = {layer: [] for layer in shared}
    for step in range(STEPS):
        choice = {layer: schedule.active(f"transformer.{layer}", step) for layer in shared}
        for layer in shared:
            history[layer].append(choice[layer])
        expected = copy.deepcopy(base)
        keep_subject = [LAYERS[0]] + [la for la in shared if choice[la] == 0]
        keep_style = [LAYERS[3]] + [la for la in shared if choice[la] == 1]
        loraweave.apply(
            expected,
            [AdapterSpec(_only(subject, keep_subject), 1.0), AdapterSpec(_only(style, keep_style), 2.0)],
            mode="merge",
        )
        with torch.no_grad():
            assert rel_err(flux_forward(model), flux_forward(expected)) <= 1e-5, (step, choice)
        callback(None, step, None, {})
    for seq in history.values():  # at most one flip, always subject -> style
        assert seq == sorted(seq)
    handle.remove()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), base.state_dict().values(), strict=True)
    )


def test_select_modes_refuse_merge_and_need_two_adapters():
    base = tiny_flux()
    a, b = _lora(base, LAYERS, 1), _lora(base, LAYERS, 2)
    with pytest.raises(ValueError, match="runtime"):
        loraweave.apply(copy.deepcopy(base), [a, b], mode="merge", stack="klora")
    with pytest.raises(ValueError, match="two"):
        loraweave.apply(copy.deepcopy(base), [a], stack="estlora")
