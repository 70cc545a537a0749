"""LORA_STACK inside ComfyUI (loraweave.comfy.stack.apply_stack) on the tiny Flux.

References: ComfyUI's core LoraLoader chained over the rows (sum), core LoraLoader on the file cut down to the
blocks a block-weight vector keeps, PEFT's `merge_utils.ties` on one shared layer (fp64 ΔW from the factors).
Merged weights are read as ComfyUI computes them (`patch_weight_to_device(..., return_weight=True)`): relative
1e-6; sampled LATENTs: absolute 1e-5."""

from __future__ import annotations

import re

import pytest
import torch
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    FLUX_TARGETS,
    core_lora,
    flux_fixture,
    kohya_flux_lora,
    nothing_loaded_fixture,
    sample,
)

from loraweave.comfy.runtime import KEY
from loraweave.comfy.stack import apply_stack
from loraweave.errors import ArgumentError, NoKeysLandedError

pytestmark = pytest.mark.usefixtures("one_thread", "nothing_loaded")
ATOL = 1e-5
STEPS = 4
SHARED = "double_blocks.0.img_attn.proj"  # a layer both rows touch (lora_b covers the first four targets)


@pytest.fixture(scope="module")
def loras(flux):
    return kohya_flux_lora(flux, seed=31), kohya_flux_lora(flux, seed=32, rank=6, targets=FLUX_TARGETS[:4])


def weights_of(patcher) -> dict[str, torch.Tensor]:
    """Every targeted weight as ComfyUI would load it (its patches applied), the model left untouched."""
    keys = [f"diffusion_model.{t}.weight" for t in FLUX_TARGETS]
    return {k: patcher.patch_weight_to_device(k, return_weight=True) for k in keys}


def same_weights(a, b, rtol=1e-6) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=rtol, atol=rtol * b[k].abs().max().item()) for k in a)


def test_sum_merge_equals_core_chain_and_runtime_equals_merge(flux, loras):
    rows = [(loras[0], 0.7, 1.0), (loras[1], -0.4, 1.0)]
    merged, _, report = apply_stack(flux, None, rows, mode="merge")
    assert report.keys_applied == report.keys_total == 3 * 8 + 3 * 4 and report.ok
    core = core_lora(core_lora(flux, loras[0], 0.7), loras[1], -0.4)
    assert same_weights(weights_of(merged), weights_of(core))
    runtime, _, report = apply_stack(flux, None, rows, mode="runtime")
    assert list(runtime.injections) == [KEY] and report.keys_applied == report.keys_total
    assert torch.allclose(
        sample(runtime, STEPS)["samples"], sample(merged, STEPS)["samples"], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("value", ["0,1,0", "DOUBLE", "0,1,0.0"])
def test_block_weights_keep_only_double_blocks(flux, loras, value):
    merged, _, _ = apply_stack(flux, None, [(loras[0], 0.9, 1.0)], block_weights=value, mode="merge")
    double_only = {k: v for k, v in loras[0].items() if "double_blocks" in k}
    assert len(double_only) < len(loras[0])
    assert same_weights(weights_of(merged), weights_of(core_lora(flux, double_only, 0.9)))


def test_block_weights_scale_a_block_in_both_modes(flux, loras):
    rows = [(loras[0], 1.0, 1.0)]
    merged, _, _ = apply_stack(flux, None, rows, block_weights="1,0.25,1", mode="merge")
    single = {k: v for k, v in loras[0].items() if "single_blocks" in k}
    double = {k: v for k, v in loras[0].items() if "double_blocks" in k}
    assert same_weights(weights_of(merged), weights_of(core_lora(core_lora(flux, double, 0.25), single, 1.0)))
    runtime, _, _ = apply_stack(flux, None, rows, block_weights="1,0.25,1", mode="runtime")
    assert torch.allclose(
        sample(runtime, STEPS)["samples"], sample(merged, STEPS)["samples"], atol=ATOL, rtol=0
    )


def unit_delta(lora: dict, target: str) -> torch.Tensor:
    """γ·up·down of one kohya target in fp64 (γ = alpha / rank)."""
    stem = "lora_unet_" + target.replace(".", "_")
    down, up = lora[f"{stem}.lora_down.weight"].double(), lora[f"{stem}.lora_up.weight"].double()
    return float(lora[f"{stem}.alpha"]) / down.shape[0] * (up @ down)


def test_ties_equals_peft_on_a_shared_layer_and_runtime_equals_merge(flux, loras):
    from peft.utils.merge_utils import ties

    rows = [(loras[0], 0.8, 1.0), (loras[1], 0.5, 1.0)]
    merged, _, report = apply_stack(flux, None, rows, stack_mode="ties", density=0.4, mode="merge")
    assert report.ok
    got = weights_of(merged)
    base = flux.model.diffusion_model.get_submodule(SHARED).weight.double()
    deltas = [unit_delta(lora, SHARED) for lora in loras]
    expected = base + ties(deltas, torch.tensor([0.8, 0.5], dtype=torch.float64), 0.4)
    assert torch.allclose(got[f"diffusion_model.{SHARED}.weight"].double(), expected, rtol=0, atol=1e-6)
    # a layer only lora_a touches is left as the plain sum
    alone = "double_blocks.0.txt_mlp.2"
    core = weights_of(core_lora(flux, loras[0], 0.8))
    assert torch.allclose(
        got[f"diffusion_model.{alone}.weight"], core[f"diffusion_model.{alone}.weight"], atol=1e-7
    )
    runtime, _, _ = apply_stack(flux, None, rows, stack_mode="ties", density=0.4, mode="runtime")
    assert torch.allclose(
        sample(runtime, STEPS)["samples"], sample(merged, STEPS)["samples"], atol=ATOL, rtol=0
    )


def test_a_stack_after_a_runtime_loader_and_zero_rows(flux, loras):
    first, _, _ = apply_stack(flux, None, [(loras[0], 0.6, 1.0)], mode="runtime")
    both, _, report = apply_stack(first, None, [(loras[0], 0.0, 0.0), (loras[1], 0.3, 1.0)], mode="runtime")
    assert [a["name"] for a in report.adapters] == ["adapter#2"]  # the zero row is skipped, names stay apart
    state = both.get_attachment(KEY)
    assert len(state.entries) == 2
    core = core_lora(core_lora(flux, loras[0], 0.6), loras[1], 0.3)
    assert torch.allclose(sample(both, STEPS)["samples"], sample(core, STEPS)["samples"], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    ("stack", "kwargs"),
    [
        ("not a stack", {}),
        ([("x.safetensors", 1.0)], {}),
        ([("x.safetensors", "1.0", 1.0)], {}),
        ([(3, 1.0, 1.0)], {}),
        ([("x.safetensors", 1.0, 1.0)], {"stack_mode": "klora"}),
        ([("x.safetensors", 1.0, 1.0)], {"stack_mode": "median"}),
        ([("x.safetensors", 1.0, 1.0)], {"stack_mode": "ties", "density": 0.0}),
        ([("x.safetensors", 1.0, 1.0)], {"block_weights": "1,2,3,4"}),
        ([("x.safetensors", 1.0, 1.0)], {"block_weights": "NOPE"}),
    ],
)
def test_bad_stack_arguments_are_typed_errors(flux, stack, kwargs):
    with pytest.raises(ArgumentError):
        apply_stack(flux, None, stack, **kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), "0.5", None, True])
@pytest.mark.parametrize("column", ["model_strength", "clip_strength"])
def test_a_row_strength_that_is_no_finite_number_is_refused_naming_the_row(flux, bad, column):
    """The one LORA_STACK reader (also the node's) refuses NaN, inf, text and bools by apply's strength rule,
    naming the row and the column, before any file is read; the input is unchanged."""
    row = {"model_strength": 1.0, "clip_strength": 1.0, column: bad}
    stack = [
        ("first.safetensors", 1.0, 1.0),
        ("second.safetensors", row["model_strength"], row["clip_strength"]),
    ]
    before = (dict(flux.patches), dict(flux.injections), flux.patches_uuid)
    with pytest.raises(ArgumentError, match=re.escape(f"lora_stack[1] {column} must be a finite number")):
        apply_stack(flux, None, stack)
    assert (dict(flux.patches), dict(flux.injections), flux.patches_uuid) == before


def test_a_wrong_model_row_is_refused_and_the_input_unchanged(flux, loras):
    alien = {
        "lora_unet_input_blocks_1_1_proj_in.lora_down.weight": torch.ones(2, 8),
        "lora_unet_input_blocks_1_1_proj_in.lora_up.weight": torch.ones(8, 2),
    }
    before = (dict(flux.patches), dict(flux.injections), flux.patches_uuid)
    for mode in ("merge", "runtime"):
        with pytest.raises(NoKeysLandedError):
            apply_stack(flux, None, [(loras[0], 1.0, 1.0), (alien, 1.0, 1.0)], mode=mode)
    assert (dict(flux.patches), dict(flux.injections), flux.patches_uuid) == before


def test_block_weights_on_wan_blocks():
    """A second DiT block map (Wan: BASE + B00, B01): '0,1,0' keeps block 0 only, bit-identical to core on the
    file cut to block 0 (ComfyUI's generic `diffusion_model.` key layout, which core lands)."""
    from helpers.comfy_models import tiny_wan

    wan = tiny_wan().patcher
    model = wan.model.diffusion_model
    g = torch.Generator().manual_seed(51)
    lora = {}
    for name, module in model.named_modules():
        if name.startswith("blocks.") and isinstance(module, torch.nn.Linear):
            rows, cols = module.weight.shape
            lora[f"diffusion_model.{name}.lora_down.weight"] = torch.randn(4, cols, generator=g) * 0.1
            lora[f"diffusion_model.{name}.lora_up.weight"] = torch.randn(rows, 4, generator=g) * 0.1
    merged, _, report = apply_stack(wan, None, [(lora, 0.7, 1.0)], block_weights="0,1,0", mode="merge")
    assert report.keys_applied == report.keys_total == len(lora)
    core = core_lora(wan, {k: v for k, v in lora.items() if ".blocks.0." in k}, 0.7)
    keys = [f"diffusion_model.{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    for key in keys:
        got = merged.patch_weight_to_device(key, return_weight=True)
        assert torch.equal(got, core.patch_weight_to_device(key, return_weight=True)), key


def test_runtime_stack_with_a_clip_nothing_lands_on(flux, loras):
    from helpers.comfy_models import tiny_clip

    clip = tiny_clip("flux")
    model, new_clip, report = apply_stack(flux, clip, [(loras[0], 0.5, 1.0)], mode="runtime")
    assert report.keys_applied == report.keys_total and KEY in model.injections
    assert new_clip is not clip and KEY not in new_clip.patcher.injections
