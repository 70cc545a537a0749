"""Workflows through ComfyUI's own executor (execution.PromptExecutor, in process, no server): the
tiny Flux from a test-only source node, our loader through loraweave.comfy.load_lora_for_models, core
KSampler, and a test-only capture node holding the LATENT.

Checked: the LATENT with our loader differs from the one without; merge and runtime agree within 1e-5, and
both with core LoraLoader's merge; a lowvram load, partial under a small budget, gives the full load's LATENT;
a re-queue with a changed runtime strength re-patches no weight."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    CAPTURED,
    REGISTRY,
    CallCounter,
    budget_loads,
    flux_fixture,
    kohya_flux_lora,
    make_executor,
    nothing_loaded_fixture,
    register_test_nodes,
    run_prompt,
    sampling_prompt,
    unload_all,
)

pytestmark = pytest.mark.usefixtures("one_thread", "nothing_loaded")
ATOL = 1e-5
BUDGET = 256 * 1024  # bytes: the tiny Flux is ~4 MB, so most of its layers stay offloaded (lowvram patches)


@pytest.fixture(autouse=True)
def workflow(flux, monkeypatch):
    register_test_nodes(monkeypatch)
    monkeypatch.setitem(REGISTRY, "base", flux)
    monkeypatch.setitem(REGISTRY, "lora_a", kohya_flux_lora(flux, seed=21))
    monkeypatch.setitem(REGISTRY, "lora_b", kohya_flux_lora(flux, seed=22, rank=8))
    CAPTURED.clear()


def latent_of(loras: list[tuple[str, float, str]], executor=None) -> torch.Tensor:
    tag = f"run{len(CAPTURED)}"
    run_prompt(executor or make_executor(), sampling_prompt(loras, tag))
    return CAPTURED[tag]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=ATOL)


def test_loader_changes_the_latent_and_merge_equals_runtime():
    base = latent_of([])
    runtime = latent_of([("lora_a", 0.8, "runtime")])
    merge = latent_of([("lora_a", 0.8, "merge")])
    core = latent_of([("lora_a", 0.8, "core")])
    assert (runtime - base).abs().max() > 100 * ATOL, "our loader left the LATENT as it was"
    assert close(runtime, merge) and close(runtime, core)


def test_two_runtime_loaders_equal_two_core_loaders():
    ours = latent_of([("lora_a", 0.8, "runtime"), ("lora_b", -0.5, "runtime")])
    core = latent_of([("lora_a", 0.8, "core"), ("lora_b", -0.5, "core")])
    assert close(ours, core) and not close(ours, latent_of([("lora_a", 0.8, "runtime")]))


@pytest.mark.parametrize("mode", ["runtime", "merge"])
def test_lowvram_partial_load_equals_full_load(flux, monkeypatch, mode):
    full = latent_of([("lora_a", 0.8, mode), ("lora_b", 0.6, mode)])
    unload_all(flux)
    loads = budget_loads(monkeypatch, BUDGET)
    partial = latent_of([("lora_a", 0.8, mode), ("lora_b", 0.6, mode)])
    (load,) = [x for x in loads if x["model"] is flux.model]
    assert load["lowvram"] and load["loaded"] < load["size"] / 2, (
        f"the budget did not force a partial load: {load}"
    )
    if mode == "merge":
        assert load["patches"] > 0, "no layer took the lowvram patch path"
    assert close(partial, full)


def test_requeue_with_a_new_strength_repatches_no_weight(flux, monkeypatch):
    executor = make_executor()  # one executor: the model source is cached, as in a running ComfyUI
    latent_of([("lora_a", 0.8, "runtime")], executor)
    with CallCounter() as counter:
        changed = latent_of([("lora_a", 0.3, "runtime")], executor)
    assert counter.calls == 0 and flux.model.current_weight_patches_uuid == flux.patches_uuid
    assert close(changed, latent_of([("lora_a", 0.3, "core")]))
