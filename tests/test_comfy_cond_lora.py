"""LoRAs per conditioning (LoraWeaveConditioningLoRA + LoraWeaveConditioningRuntime) against ComfyUI's own
hook workflow, through ComfyUI's PromptExecutor in process, on tiny SD1.5, SDXL and Flux MODELs: a LoRA on the
positive only (CFG on), and two masked regions with a LoRA each, the second keyframed to a step window.

Checked per case: the LATENT equals the core hooks' within 1e-5 relative (fp32; the reference merges
W + s·ΔW for each hook group, we add the low-rank term per sample); the LoRA changes the LATENT; the model is
called as often as in the hook-free workflow (one batch per step) where core hooks call it once per hook group
and step; no calculate_weight call and no hook patch (cached or not) while ours samples. The same for the core
hook graph whose MODEL goes through our node with core_lora_hooks on. Errors: a file of another architecture,
a broken file and a NaN strength fail with the file named (the last two at queue time), MODEL and
CONDITIONING unchanged."""

from __future__ import annotations

import asyncio
import math
import uuid
from pathlib import Path

import pytest
import torch
from helpers.comfy_env import import_comfy, prompt_executor
from helpers.comfy_hooks import (
    CONDS,
    STEPS,
    ForwardCounter,
    Graph,
    HookPatchCounter,
    build_case,
    publish,
    register_nodes,
    te_lora,
)
from helpers.comfy_hooks import workflow as make_workflow
from helpers.comfy_sampling import CAPTURED, REGISTRY, CallCounter, StubServer, kohya_flux_lora, unload_all

from loraweave.comfy.conditioning import COND_KEY, KEY

pytestmark = pytest.mark.usefixtures("one_thread")
REL_TOL = 1e-5
BROKEN = "cond_broken.safetensors"
# model calls per step of core hooks: one per hook group (the positive's, each region's, the negative's)
CORE_CALLS_PER_STEP = {"positive": 2, "regions": 3}


@pytest.fixture(scope="module", name="cases")
def cases_fixture(tmp_path_factory):
    """The three tiny models, their LoRA files (and a broken one) in a loras folder ComfyUI lists."""
    import_comfy()
    import folder_paths

    loras = tmp_path_factory.mktemp("cond_loras")
    (loras / BROKEN).write_bytes(b"\xff" * 8 + b"not a safetensors header")
    folder_paths.add_model_folder_path("loras", str(loras))
    return {name: build_case(name, loras) for name in ("sd15", "sdxl", "flux")}


@pytest.fixture(autouse=True)
def nodes_registered(monkeypatch, cases):
    register_nodes(monkeypatch)
    CAPTURED.clear()


def execute(prompt: dict):
    """(node errors of ComfyUI's validate_prompt, PromptExecutor after running a valid prompt in process)."""
    import execution

    prompt_id = str(uuid.uuid4())
    valid, _, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    if not valid:
        return node_errors, None
    ex = prompt_executor(StubServer())
    ex.execute(prompt, prompt_id, extra_data={}, execute_outputs=outputs)
    return {}, ex


HOOK_FREE: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}  # the LoRA-free runs, shared by the kinds


def latent_and_calls(case, kind: str, how: str) -> tuple[torch.Tensor, int]:
    graph = (case.name, "regions" if kind == "regions" else "plain")
    if how == "none" and graph in HOOK_FREE:
        return HOOK_FREE[graph]
    tag = f"{case.name}-{kind}-{how}"
    with ForwardCounter(case.patcher) as counter:
        node_errors, ex = execute(make_workflow(case, kind, how, tag))
    assert ex is not None and ex.success, node_errors or ex.status_messages
    if how == "none":
        HOOK_FREE[graph] = CAPTURED[tag], counter.calls
    return CAPTURED[tag], counter.calls


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("kind", ["positive", "regions"])
@pytest.mark.parametrize("name", ["sd15", "sdxl", "flux"])
def test_equals_core_hooks_in_the_hook_free_batches(cases, name, kind, monkeypatch):
    case = cases[name]
    publish(case, monkeypatch)
    unload_all(case.patcher)
    hook_patches = HookPatchCounter(monkeypatch)
    none, calls_none = latent_and_calls(case, kind, "none")
    core, calls_core = latent_and_calls(case, kind, "core")
    assert hook_patches.calls > 0, "the core workflow patched no hook group: not a reference"
    hook_patches.calls = 0
    with CallCounter() as weights:
        ours, calls_ours = latent_and_calls(case, kind, "ours")
        fast, calls_fast = latent_and_calls(case, kind, "accelerated")
    unload_all(case.patcher)
    assert weights.calls == 0 and hook_patches.calls == 0, (weights.calls, hook_patches.calls)
    assert rel(none, core) > 20 * REL_TOL, "the LoRA changed nothing: the comparison proves nothing"
    assert rel(ours, core) < REL_TOL and rel(fast, core) < REL_TOL, (rel(ours, core), rel(fast, core))
    assert calls_ours == calls_fast == calls_none == STEPS
    assert calls_core == CORE_CALLS_PER_STEP[kind] * STEPS


def snapshot(patcher) -> tuple:
    return (
        dict(patcher.attachments),
        {k: dict(v) for k, v in patcher.wrappers.items()},
        dict(patcher.injections),
        dict(patcher.additional_models),
        {k: list(v) for k, v in patcher.patches.items()},
    )


@pytest.mark.parametrize(
    ("lora", "strength", "node", "words"),
    [
        ("cond_sd15_a.safetensors", 0.8, "KSampler", "no key landed"),
        (BROKEN, 0.8, "LoraWeaveConditioningLoRA", BROKEN),
        ("cond_flux_a.safetensors", math.nan, "LoraWeaveConditioningLoRA", "strength"),
    ],
)
def test_errors_name_the_file_and_change_nothing(cases, lora, strength, node, words, monkeypatch):
    """A broken file and a NaN strength are refused when the prompt is queued (ComfyUI's validation, on our
    node); a file of another architecture fails the run on the sampler, which is where the MODEL meets it."""
    case = cases["flux"]
    publish(case, monkeypatch)
    before, cond = snapshot(case.patcher), case.conds["pos"]
    prompt = make_workflow(case, "positive", "ours", "error")
    ours = next(n for n in prompt.values() if n["class_type"] == "LoraWeaveConditioningLoRA")
    ours["inputs"] |= {"lora_name": lora, "strength": strength}
    node_errors, ex = execute(prompt)
    unload_all(case.patcher)
    if ex is None:  # refused at queue time
        (found,) = node_errors.values()
        said = " ".join(e["details"] for e in found["errors"])
        assert found["class_type"] == node and words in said, found
    else:
        assert not ex.success
        (error,) = [data for event, data in ex.status_messages if event == "execution_error"]
        assert error["node_type"] == node and words in error["exception_message"], error
        assert lora in error["exception_message"], error
    assert snapshot(case.patcher) == before
    assert COND_KEY not in cond[0][1] and KEY not in case.patcher.attachments


def test_script_api_takes_a_state_dict_and_leaves_the_input(cases):
    from loraweave.comfy import conditioning_lora
    from loraweave.errors import ArgumentError, ArgumentTypeError

    case = cases["flux"]
    cond = case.conds["pos"]
    sd = kohya_flux_lora(case.patcher, seed=21)
    out = conditioning_lora(conditioning_lora(cond, sd, 0.5), sd, 0.8, 0.25, 0.75)
    first, second = out[0][1][COND_KEY]
    assert (first.strength, first.window, second.strength) == (0.5, None, 0.8)
    assert (second.window.start, second.window.end) == (0.25, 0.75)
    assert out[0][0] is cond[0][0] and COND_KEY not in cond[0][1]
    with pytest.raises(ArgumentError):
        conditioning_lora(cond, sd, 1.0, 0.6, 0.4)
    with pytest.raises(ArgumentTypeError):
        conditioning_lora(case.patcher, sd)


def test_a_lora_stack_equals_chaining_the_node(cases, monkeypatch):
    """lora_stack rows (each at its model_strength) then lora_name: the LATENT of the node chained once per
    LoRA; without the stack row's LoRA the LATENT differs (the row was applied, at its strength)."""
    import nodes

    from loraweave.comfy.nodes import LoraWeaveStack

    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "LoraWeaveStack", LoraWeaveStack)
    case = cases["flux"]
    publish(case, monkeypatch)
    a, b = case.loras
    latents = {}
    for how in ("stack", "chain", "b only"):
        prompt = make_workflow(case, "positive", "ours", how)
        ours = next(n for n in prompt.values() if n["class_type"] == "LoraWeaveConditioningLoRA")
        ours["inputs"] |= {"lora_name": b, "strength": 1.2}
        if how == "stack":
            row = {"lora_name": a, "model_strength": 0.9, "clip_strength": 0.0, "enabled": True}
            prompt["stack"] = {"class_type": "LoraWeaveStack", "inputs": row}
            ours["inputs"]["lora_stack"] = ["stack", 0]
        elif how == "chain":
            first = {**ours["inputs"], "lora_name": a, "strength": 0.9}
            prompt["first"] = {"class_type": "LoraWeaveConditioningLoRA", "inputs": first}
            ours["inputs"]["conditioning"] = ["first", 0]
        node_errors, ex = execute(prompt)
        assert ex is not None and ex.success, node_errors or ex.status_messages
        latents[how] = CAPTURED[how]
    unload_all(case.patcher)
    assert rel(latents["stack"], latents["chain"]) < REL_TOL, rel(latents["stack"], latents["chain"])
    assert rel(latents["b only"], latents["chain"]) > 20 * REL_TOL, "the stack row changed nothing"


def test_text_encode_puts_the_te_part_on_its_prompt_only(cases, monkeypatch):
    """LoraWeaveConditioningTextEncode (positive) beside core's CLIPTextEncode (negative) on the same CLIP in
    one prompt: the positive equals the encode of core's LoRA-patched CLIP (comfy.sd.load_lora_for_models,
    strength_model 0) and carries the denoiser part at its strength; the negative equals the plain CLIP's; the
    input CLIP is unchanged."""
    import folder_paths
    from helpers.comfy_models import tiny_clip
    from safetensors.torch import save_file

    case = cases["flux"]
    clip = tiny_clip("flux")
    lora = {**kohya_flux_lora(case.patcher, seed=23), **te_lora(clip, seed=41)}
    name = "cond_flux_te.safetensors"
    folder = Path(folder_paths.get_full_path("loras", case.loras[0])).parent
    save_file(lora, folder / name)
    monkeypatch.setitem(REGISTRY, "te_clip", clip)
    before = snapshot(clip.patcher)
    texts = {"pos": "a tiny test prompt", "neg": "blurry"}
    g = Graph()
    source = g.add("LWTestClip", name="te_clip")
    pos = g.add(
        "LoraWeaveConditioningTextEncode",
        clip=source,
        text=texts["pos"],
        lora_name=name,
        strength=0.8,
        strength_clip=0.6,
        start_percent=0.0,
        end_percent=1.0,
    )
    neg = g.add("CLIPTextEncode", clip=source, text=texts["neg"])
    g.add("LWTestCondCapture", conditioning=pos, tag="pos")
    g.add("LWTestCondCapture", conditioning=neg, tag="neg")
    node_errors, ex = execute(g.nodes)
    assert ex is not None and ex.success, node_errors or ex.status_messages
    assert snapshot(clip.patcher) == before, "the input CLIP was modified"
    _, core_clip = import_comfy().sd.load_lora_for_models(case.patcher, clip, lora, 0.0, 0.6)

    def encoded(c, text):
        ((cond, extra),) = c.encode_from_tokens_scheduled(c.tokenize(text))
        return torch.cat([cond.flatten(), extra["pooled_output"].flatten()])

    got = {k: torch.cat([CONDS[k][0][0].flatten(), CONDS[k][0][1]["pooled_output"].flatten()]) for k in texts}
    plain = encoded(clip, texts["pos"])
    assert (got["pos"] - plain).abs().max() > 1e-2, "the text-encoder part changed nothing"
    assert torch.allclose(got["pos"], encoded(core_clip, texts["pos"]), rtol=0, atol=1e-6)
    assert torch.equal(got["neg"], encoded(clip, texts["neg"]))
    (item,) = CONDS["pos"][0][1][COND_KEY]
    assert (item.strength, item.window, item.label) == (0.8, None, name)
    assert COND_KEY not in CONDS["neg"][0][1]
    unload_all(clip.patcher, core_clip.patcher)
