"""The one decision path (engine/decide.py): `apply` and a whole-model face (ComfyUI) check the mode and the
strengths by one rule with one typed error, mean the same by `auto`, and refuse strict and empty results with
one wording, leaving the model as it was. The ComfyUI side of the same calls: tests/test_comfy_errors.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import loraweave
from loraweave.engine.decide import check_mode, check_strengths, chosen_mode, refuse, strict_message
from loraweave.errors import ArgumentError, NoKeysLandedError, StrictApplyError


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.fc = nn.Linear(8, 6)
    return model


def _lora(prefix: str = "fc", out: int = 6, inp: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        f"{prefix}.lora_down.weight": torch.randn(2, inp, generator=g),
        f"{prefix}.lora_up.weight": torch.randn(out, 2, generator=g),
    }


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("mode", ["fuse", "", None, "AUTO"])
def test_apply_refuses_an_unknown_mode_with_the_typed_error(mode):
    model = _model()
    before = _weights(model)
    with pytest.raises(ArgumentError, match=r"mode must be one of auto, merge, runtime, got") as caught:
        loraweave.apply(model, _lora(), mode=mode)
    assert isinstance(caught.value, ValueError)  # callers catching ValueError still do
    _unchanged(model, before)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "0.5", True, None, 1e5])
def test_strengths_by_one_rule_naming_the_argument(bad):
    with pytest.raises(ArgumentError, match="strength_clip must be a finite number"):
        check_strengths(1.0, bad, labels=("strength_model", "strength_clip"))
    assert check_strengths(0.5, -2, labels=("a", "b")) == (0.5, -2.0)
    model = _model()
    with pytest.raises(ArgumentError, match="strength"):
        loraweave.apply(model, _lora(), strength=bad)


def test_auto_means_runtime_on_a_quantized_base_and_merge_on_a_float_one():
    assert chosen_mode("auto", quantized_base=True) == "runtime"
    assert chosen_mode("auto", quantized_base=False) == "merge"
    for mode in ("merge", "runtime"):
        assert chosen_mode(mode, True) == mode and chosen_mode(mode, False) == mode
    assert check_mode("merge") == "merge"
    with pytest.raises(ArgumentError):
        chosen_mode("fuse", False)


def test_strict_and_empty_refusals_have_one_wording_and_change_nothing():
    model = _model()
    before = _weights(model)
    partial = {**_lora(), **_lora("nosuch")}
    with pytest.raises(StrictApplyError) as caught:
        loraweave.apply(model, partial, strict=True)
    report = caught.value.report
    assert str(caught.value) == strict_message(report)
    assert str(caught.value).startswith("strict: 2 keys did not land (") and "no_such_module" in str(
        caught.value
    )
    _unchanged(model, before)
    with pytest.raises(NoKeysLandedError):
        loraweave.apply(model, _lora("nosuch"))
    _unchanged(model, before)
    with loraweave.apply(model, _lora("nosuch"), allow_empty=True) as handle:
        assert handle.report.keys_applied == 0
    # the same report refused by the engine's function directly: the same type and words
    with pytest.raises(StrictApplyError) as again:
        refuse(report, strict=True)
    assert str(again.value) == str(caught.value)
    refuse(report, strict=False)  # something landed: not strict, not empty
