"""loraweave.comfy on what only video models do: Wan 2.2 A14B's high- and low-noise experts, which ComfyUI
loads as two MODELs (helpers.comfy_video). Reference: `loraweave.apply` on each expert's diffusers twin,
ComfyUI's merged weights mapped through diffusers' converter (1e-6 relative per weight). The video
architectures' layouts, weights and runtime run with every other case: test_comfy_arch_names.py,
test_comfy_arch_weights.py."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.comfy_arch_cases import layout_file
from helpers.comfy_checks import TOL, all_linears, check_against_twin, comfy_modules, merged_state, rel
from helpers.comfy_files import adapter_file, dotted
from helpers.comfy_video import tiny_wan22_expert

import loraweave
from loraweave.comfy import load_lora_for_models

LAYOUTS = ("kohya-diffusers", "comfy", "diffusers", "peft")


@pytest.fixture(scope="module")
def experts():
    return tiny_wan22_expert(0), tiny_wan22_expert(1)


def test_wan22_experts_take_one_file_each_at_its_strength(experts):
    # Wan 2.2 A14B: ComfyUI loads the high- and low-noise experts as two MODELs; a LoRA trained for both is
    # loaded on each (two loader nodes), each at its own strength. Each merge equals loraweave.apply on its
    # own twin.
    high, low = experts
    sd = adapter_file(all_linears(comfy_modules(high)), "lora", dotted("diffusion_model."))
    for m, strength in ((high, 1.0), (low, 0.4)):
        model, _, report = load_lora_for_models(m.patcher, None, sd, strength, 0.0, mode="merge")
        assert report.keys_applied == report.keys_total == len(sd), report.kinds()
        twin = copy.deepcopy(m.diffusers)
        loraweave.apply(twin, sd, mode="merge", strength=strength)
        ours, ref = m.as_diffusers(merged_state(model)), twin.state_dict()
        assert max(rel(ours[k], ref[k]) for k in ref) <= TOL
    assert not torch.equal(
        comfy_modules(high).blocks[0].ffn[0].weight, comfy_modules(low).blocks[0].ffn[0].weight
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_wan22_expert_layouts(experts, layout):
    m = experts[1]
    check_against_twin(m.as_diffusers, m, layout_file(m, layout))
