"""Parity with PEFT on tiny real diffusers models: merged weights and runtime outputs.

Tolerances: merged weights rel. error (max|ours-ref| / max|ref|) <= 1e-6 in fp32; runtime outputs <= 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.peft_lora import make_peft_lora, rel_err
from peft.tuners.tuners_utils import BaseTunerLayer

import loraweave

MERGE_TOL = 1e-6
RUNTIME_TOL = 1e-5


def peft_merged_state(peft_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    merged = copy.deepcopy(peft_model)
    for module in merged.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()
    return {k.replace(".base_layer", ""): v for k, v in merged.state_dict().items() if "lora_" not in k}


@pytest.mark.parametrize("arch", ["flux", "zimage", "sdxl_unet"])
def test_merge_equals_peft_merge(arch, tmp_path):
    base, peft_model, path, _ = make_peft_lora(arch, tmp_path)
    ref = peft_merged_state(peft_model)
    ours = copy.deepcopy(base)
    handle = loraweave.apply(ours, path, mode="merge", strict=True)
    assert handle.report.keys_applied == handle.report.keys_total > 0
    assert handle.report.adapters[0]["alpha_sources"].keys() <= {"metadata:peft", "metadata:peft_pattern"}
    changed = 0
    for name, tensor in ours.state_dict().items():
        assert rel_err(tensor, ref[name]) <= MERGE_TOL, name
        changed += not torch.equal(tensor, base.state_dict()[name])
    assert changed == len(handle.report.applied)
    handle.remove()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, base.state_dict()[name]), name


@pytest.mark.parametrize("arch", ["flux", "zimage", "sdxl_unet"])
def test_runtime_equals_peft_forward(arch, tmp_path):
    base, peft_model, path, forward = make_peft_lora(arch, tmp_path)
    with torch.no_grad():
        ref = forward(peft_model)
        plain = forward(base)
        ours = copy.deepcopy(base)
        before = {k: v.clone() for k, v in ours.state_dict().items()}
        with loraweave.apply(ours, path, mode="runtime", strict=True) as handle:
            out = forward(ours)
            assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())
            assert {m.mechanism for m in handle.report.applied} == {"runtime"}
        assert rel_err(out, ref) <= RUNTIME_TOL
        assert rel_err(plain, ref) > 100 * RUNTIME_TOL  # the LoRA really changes the output
        assert torch.equal(forward(ours), plain)  # hooks are gone after the context


@pytest.mark.parametrize("arch", ["flux", "zimage", "sdxl_unet"])
def test_auto_merges_plain_weights_and_matches_runtime(arch, tmp_path):
    base, _, path, forward = make_peft_lora(arch, tmp_path)
    with torch.no_grad():
        merged_model = copy.deepcopy(base)
        runtime_model = copy.deepcopy(base)
        h_auto = loraweave.apply(merged_model, path, mode="auto")
        loraweave.apply(runtime_model, path, mode="runtime")
        assert {m.mechanism for m in h_auto.report.applied} == {"merge"}
        assert rel_err(forward(merged_model), forward(runtime_model)) <= RUNTIME_TOL
