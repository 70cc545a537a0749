"""Sampling inside ComfyUI for the runtime, step-window and executor tests: LoRA files on the tiny Flux, Flux
conditioning, samplers run through ComfyUI's own nodes, a calculate_weight counter, and test-only nodes for
`execution.PromptExecutor` (in process: no server, CPU args set before comfy.model_management is imported).

The LoRAs are kohya-layout Flux files (`lora_unet_double_blocks_0_img_attn_qkv...`): a layout ComfyUI's core
LoraLoader lands correctly, so the core merge is an independent reference for loraweave's runtime paths."""

from __future__ import annotations

import asyncio
import gc
import uuid

import pytest
import torch

from .comfy_env import import_comfy, prompt_executor
from .comfy_models import flux_state_dict

# Every Linear kind of the tiny Flux: fused qkv, attention out, MLP, modulation, the single block's linear1/2.
FLUX_TARGETS = (
    "double_blocks.0.img_attn.qkv",
    "double_blocks.0.img_attn.proj",
    "double_blocks.0.txt_attn.qkv",
    "double_blocks.0.img_mlp.0",
    "double_blocks.0.txt_mlp.2",
    "double_blocks.0.img_mod.lin",
    "single_blocks.0.linear1",
    "single_blocks.0.linear2",
)
TEXT_DIM = 32  # tiny Flux context_in_dim and vec_in_dim (comfy_models.FLUX_PARAMS)


def tiny_flux_patcher(seed: int = 0, **params):
    """The tiny Flux MODEL alone (no CLIP, no diffusers twin), loaded as UNETLoader does; `params` override
    comfy_models.FLUX_PARAMS (ComfyUI detects the model from the state dict)."""
    c = import_comfy()
    sd = flux_state_dict(seed, **params)
    return c.sd.load_diffusion_model_state_dict(
        sd, model_options={"dtype": torch.float32}, disable_dynamic=True
    )


def kohya_flux_lora(patcher, seed: int, rank: int = 4, scale: float = 0.3, targets=FLUX_TARGETS) -> dict:
    """A kohya LoRA state dict on `targets` of the ComfyUI Flux in `patcher`, alpha = rank / 2 (γ = 0.5)."""
    g = torch.Generator().manual_seed(seed)
    model = patcher.model.diffusion_model
    out = {}
    for target in targets:
        rows, cols = model.get_submodule(target).weight.shape
        stem = "lora_unet_" + target.replace(".", "_")
        out[f"{stem}.lora_down.weight"] = torch.randn(rank, cols, generator=g) * scale
        out[f"{stem}.lora_up.weight"] = torch.randn(rows, rank, generator=g) * scale
        out[f"{stem}.alpha"] = torch.tensor(rank / 2)
    return out


def flux_conditioning(seed: int, tokens: int = 6) -> list:
    """CONDITIONING for the tiny Flux without a text encoder: [[context, {pooled_output, guidance}]]."""
    g = torch.Generator().manual_seed(seed)
    context = torch.randn(1, tokens, TEXT_DIM, generator=g)
    return [[context, {"pooled_output": torch.randn(1, TEXT_DIM, generator=g), "guidance": 3.5}]]


def core_lora(patcher, lora: dict, strength: float):
    """ComfyUI's own LoraLoader path (comfy.sd.load_lora_for_models) on the model only: a merged reference."""
    c = import_comfy()
    model, _ = c.sd.load_lora_for_models(patcher, None, lora, strength, 0.0)
    return model


def sample(
    model, steps: int = 6, seed: int = 3, start: int = 0, end: int = 10000, latent=None, add_noise=True
):
    """KSamplerAdvanced (euler, simple, cfg 1) over steps [start, end); returns the LATENT samples."""
    import nodes

    latent = latent if latent is not None else {"samples": torch.zeros(1, 16, 2, 2)}
    (out,) = nodes.KSamplerAdvanced().sample(
        model,
        "enable" if add_noise else "disable",
        seed,
        steps,
        1.0,
        "euler",
        "simple",
        flux_conditioning(1),
        flux_conditioning(2),
        latent,
        start,
        end,
        "enable" if end < steps else "disable",
    )
    return out


def sigmas_of(model, steps: int) -> list[float]:
    """The sigma of each step of `sample` (euler, simple), as ComfyUI computes them."""
    import_comfy()
    import comfy.samplers

    sampling = model.get_model_object("model_sampling")
    return [float(s) for s in comfy.samplers.calculate_sigmas(sampling, "simple", steps)][:steps]


class CallCounter:
    """Counts calls of comfy.lora.calculate_weight while in its `with` block (every merge, lowvram and hook
    patch of ComfyUI goes through that one function)."""

    def __init__(self) -> None:
        self.calls = 0
        self._original = None

    def __enter__(self) -> CallCounter:
        c = import_comfy()
        self._original = original = c.lora.calculate_weight

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        c.lora.calculate_weight = counted
        return self

    def __exit__(self, *exc) -> None:
        import_comfy().lora.calculate_weight = self._original


def unload_all(*patchers) -> None:
    """Unload every model ComfyUI holds and detach `patchers` (ejects injections, restores backups, zeroes the
    loaded-memory counters): a loaded model whose last clone was collected is skipped by ComfyUI's own
    unload."""
    c = import_comfy()
    gc.collect()
    c.model_management.unload_all_models()
    for patcher in patchers:
        patcher.detach(unpatch_all=True)
    c.model_management.cleanup_models_gc()


@pytest.fixture(scope="module", name="flux")
def flux_fixture():
    """The tiny Flux MODEL, one per test module (import this fixture by name)."""
    return tiny_flux_patcher()


@pytest.fixture(name="nothing_loaded")
def nothing_loaded_fixture(flux):
    """Each test starts and ends with nothing loaded and the shared Flux detached."""
    unload_all(flux)
    yield
    unload_all(flux)


# ---- test-only nodes for execution.PromptExecutor ----------------------------------------------------------

REGISTRY: dict[str, object] = {}  # name -> object the test nodes hand out (models, LoRA state dicts)
CAPTURED: dict[str, torch.Tensor] = {}  # tag -> LATENT samples the capture node saw


def source_node(name: str, widget: tuple, output: str, make):
    """A V1 node class with one widget input `name` and one output made by `make(value)`."""

    class Source:
        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {name: widget}}

        RETURN_TYPES = (output,)
        FUNCTION = "run"
        CATEGORY = "loraweave_test"

        def run(self, **inputs):
            return (make(inputs[name]),)

    return Source


TestModelSource = source_node("name", ("STRING", {"default": ""}), "MODEL", lambda name: REGISTRY[name])
TestFluxConditioning = source_node("seed", ("INT", {"default": 0}), "CONDITIONING", flux_conditioning)
TestFluxLatent = source_node(
    "size", ("INT", {"default": 2}), "LATENT", lambda size: {"samples": torch.zeros(1, 16, size, size)}
)


class TestLoraWeave:
    """MODEL through loraweave.comfy.load_lora_for_models (the public API the nodes call), or core's
    loader."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("MODEL",),
                "lora": ("STRING", {"default": ""}),
                "strength": ("FLOAT", {"default": 1.0, "min": -10.0, "max": 10.0}),
                "mode": ("STRING", {"default": "runtime"}),
            }
        }

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "run"
    CATEGORY = "loraweave_test"

    def run(self, model, lora, strength, mode):
        if mode == "core":
            return (core_lora(model, REGISTRY[lora], strength),)
        from loraweave.comfy.api import load_lora_for_models

        out, _, _ = load_lora_for_models(model, None, REGISTRY[lora], strength, 0.0, mode=mode)
        return (out,)


class TestCapture:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "tag": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "loraweave_test"

    def run(self, samples, tag):
        CAPTURED[tag] = samples["samples"].clone()
        return {}


TEST_NODES = {
    "LWTestModelSource": TestModelSource,
    "LWTestFluxConditioning": TestFluxConditioning,
    "LWTestFluxLatent": TestFluxLatent,
    "LWTestLoraWeave": TestLoraWeave,
    "LWTestCapture": TestCapture,
}


class StubServer:
    """What PromptExecutor needs of the server: a client id, the last node id, and a sink for messages."""

    def __init__(self) -> None:
        self.client_id = None
        self.last_node_id = None
        self.messages: list[tuple[str, object]] = []

    def send_sync(self, event, data, sid=None) -> None:
        self.messages.append((event, data))

    def queue_updated(self) -> None:
        pass


def register_test_nodes(monkeypatch) -> None:
    import_comfy()
    import nodes

    for name, cls in TEST_NODES.items():
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, name, cls)


def sampling_prompt(loras: list[tuple[str, float, str]], tag: str, steps: int = 4) -> dict:
    """API-format prompt: model source -> one LWTestLoraWeave per (lora, strength, mode) -> KSampler ->
    capture."""
    prompt: dict[str, dict] = {"model": {"class_type": "LWTestModelSource", "inputs": {"name": "base"}}}
    model = ["model", 0]
    for i, (lora, strength, mode) in enumerate(loras):
        prompt[f"lora{i}"] = {
            "class_type": "LWTestLoraWeave",
            "inputs": {"model": model, "lora": lora, "strength": strength, "mode": mode},
        }
        model = [f"lora{i}", 0]
    prompt |= {
        "pos": {"class_type": "LWTestFluxConditioning", "inputs": {"seed": 1}},
        "neg": {"class_type": "LWTestFluxConditioning", "inputs": {"seed": 2}},
        "latent": {"class_type": "LWTestFluxLatent", "inputs": {"size": 2}},
        "sampler": {
            "class_type": "KSampler",
            "inputs": {
                "model": model,
                "seed": 3,
                "steps": steps,
                "cfg": 1.0,
                "sampler_name": "euler",
                "scheduler": "simple",
                "positive": ["pos", 0],
                "negative": ["neg", 0],
                "latent_image": ["latent", 0],
                "denoise": 1.0,
            },
        },
        "capture": {"class_type": "LWTestCapture", "inputs": {"samples": ["sampler", 0], "tag": tag}},
    }
    return prompt


def make_executor():
    return prompt_executor(StubServer())


def run_prompt(executor, prompt: dict) -> None:
    """Validate `prompt` as the server does, then execute it in process; fails with ComfyUI's own error
    text."""
    import execution

    prompt_id = str(uuid.uuid4())
    valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, prompt, None))
    assert valid, f"ComfyUI refused the prompt: {error} {node_errors}"
    executor.execute(prompt, prompt_id, extra_data={}, execute_outputs=outputs)
    errors = [data for event, data in executor.server.messages if event == "execution_error"]
    assert executor.success, f"ComfyUI execution failed: {errors}"


def budget_loads(monkeypatch, budget: int) -> list[dict]:
    """Make every ComfyUI model load a lowvram load under `budget` bytes (CPU loads are full otherwise); the
    returned list gets, per load, what the load left: lowvram or not, bytes loaded, lowvram patches, size."""
    c = import_comfy()
    original = c.model_management.LoadedModel.model_load
    loads: list[dict] = []

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        out = original(self, lowvram_model_memory=budget, force_patch_weights=force_patch_weights)
        model = self.model.model
        loads.append(
            {
                "model": model,
                "lowvram": model.model_lowvram,
                "loaded": model.model_loaded_weight_memory,
                "patches": model.lowvram_patch_counter,
                "size": self.model.model_size(),
            }
        )
        return out

    monkeypatch.setattr(c.model_management.LoadedModel, "model_load", model_load)
    return loads
