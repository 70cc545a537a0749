"""Conditioning LoRAs against ComfyUI's core hooks: tiny SD1.5, SDXL and Flux MODELs with their
conditionings, kohya LoRA files in ComfyUI's loras folder, and API-format prompts for the two ways to run one
LoRA per conditioning:
- core: CreateHookLora (+ CreateHookKeyframe/SetHookKeyframes for a window) -> Cond Set Props;
- ours: LoraWeaveConditioningLoRA on the conditioning, LoraWeaveConditioningRuntime on the MODEL;
- none: the same graph without any LoRA (the hook-free batching and forward count).
Regions: ConditioningSetMask (two masks) + ConditioningCombine, as a user wires them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from .comfy_env import COMFYUI_DIR, import_comfy
from .comfy_models import tiny_sd_unet
from .comfy_sampling import REGISTRY, TEST_NODES, kohya_flux_lora, source_node, tiny_flux_patcher

STEPS = 3
CFG = 2.0  # above 1: the negative runs too (cfg 1 skips it)
MASK_INPUTS = {"strength": 1.0, "set_cond_area": "default"}  # ConditioningSetMask's widgets
WINDOW = (0.3, 0.6)  # start/end percent: only step 1 of 3 (at ~0.33) on; no keyframe ties at step sigmas


@dataclass
class Case:
    name: str
    patcher: object
    latent: torch.Tensor
    conds: dict[str, list]  # pos, neg, a, b
    loras: tuple[str, str]  # file names in the loras folder


def _unet_lora(patcher, seed: int) -> dict[str, torch.Tensor]:
    """A kohya LoRA (LDM module names) on every attention and projection Linear of a ComfyUI UNet, rank 4."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in patcher.model.diffusion_model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ("attn" in name or "proj" in name):
            stem = "lora_unet_" + name.replace(".", "_")
            out[f"{stem}.lora_down.weight"] = torch.randn(4, mod.in_features, generator=g)
            out[f"{stem}.lora_up.weight"] = torch.randn(mod.out_features, 4, generator=g)
            out[f"{stem}.alpha"] = torch.tensor(2.0)
    return out


def _cond(seed: int, dim: int, pooled: bool) -> list:
    g = torch.Generator().manual_seed(seed)
    extra = {"pooled_output": torch.randn(1, dim, generator=g)} if pooled else {}
    return [[torch.randn(1, 5, dim, generator=g), extra]]


def build_case(name: str, loras_dir) -> Case:
    """The tiny model `name` (sd15, sdxl, flux), four conditionings and two LoRA files written to
    `loras_dir`."""
    if name == "flux":
        patcher = tiny_flux_patcher()
        files = [kohya_flux_lora(patcher, seed=s) for s in (21, 22)]
        latent = torch.zeros(1, 16, 4, 4)
        conds = {"pos": _cond(1, 32, True), "neg": _cond(2, 32, True)}
        for c in conds.values():
            c[0][1]["guidance"] = 3.5
    else:
        patcher = tiny_sd_unet(name).patcher
        files = [_unet_lora(patcher, s) for s in (31, 32)]
        latent = torch.zeros(1, 4, 8, 8)
        conds = {"pos": _cond(1, 32, name == "sdxl"), "neg": _cond(2, 32, name == "sdxl")}
    conds["a"] = [[conds["pos"][0][0] * 0.5, dict(conds["pos"][0][1])]]
    conds["b"] = [[conds["pos"][0][0].flip(1), dict(conds["pos"][0][1])]]
    names = (f"cond_{name}_a.safetensors", f"cond_{name}_b.safetensors")
    for file, tensors in zip(names, files, strict=True):
        save_file(tensors, loras_dir / file)
    return Case(name, patcher, latent, conds, names)


def masks(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left and right halves of the latent (ComfyUI resizes a MASK to the latent itself)."""
    h, w = latent.shape[-2:]
    left = torch.zeros(1, h, w)
    left[..., : w // 2] = 1.0
    return left, 1.0 - left


TEST_COND = source_node("name", ("STRING", {"default": ""}), "CONDITIONING", lambda name: REGISTRY[name])
TEST_MASK = source_node("name", ("STRING", {"default": ""}), "MASK", lambda name: REGISTRY[name])
TEST_LATENT = source_node("name", ("STRING", {"default": ""}), "LATENT", lambda name: REGISTRY[name])
TEST_CLIP = source_node("name", ("STRING", {"default": ""}), "CLIP", lambda name: REGISTRY[name])
CONDS: dict[str, list] = {}  # tag -> the CONDITIONING the capture node saw


class CondCapture:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"conditioning": ("CONDITIONING",), "tag": ("STRING", {"default": ""})}}

    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "run"
    CATEGORY = "loraweave_test"

    def run(self, conditioning, tag):
        CONDS[tag] = conditioning
        return {}


def te_lora(clip, seed: int, rank: int = 4) -> dict:
    """kohya text-encoder keys (lora_te1_ = CLIP-L) on every attention projection of the tiny CLIP-L."""
    g = torch.Generator().manual_seed(seed)
    layers = clip.cond_stage_model.clip_l.transformer.text_model.encoder.layers
    out = {}
    for i, layer in enumerate(layers):
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            rows, cols = getattr(layer.self_attn, proj).weight.shape
            stem = f"lora_te1_text_model_encoder_layers_{i}_self_attn_{proj}"
            out[f"{stem}.lora_down.weight"] = torch.randn(rank, cols, generator=g) * 0.3
            out[f"{stem}.lora_up.weight"] = torch.randn(rows, rank, generator=g) * 0.3
    return out


def register_nodes(monkeypatch) -> None:
    """The test-only sources and capture, and ComfyUI's hook nodes (comfy_extras/nodes_hooks.py)."""
    import_comfy()
    import nodes

    for name, cls in {
        **TEST_NODES,
        "LWTestCond": TEST_COND,
        "LWTestMask": TEST_MASK,
        "LWTestLatent": TEST_LATENT,
        "LWTestClip": TEST_CLIP,
        "LWTestCondCapture": CondCapture,
    }.items():
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, name, cls)
    from loraweave.comfy.cond_nodes import COND_NODES

    for node in COND_NODES:  # as ComfyUI registers a V3 extension's nodes
        monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node.GET_SCHEMA().node_id, node)
    if "CreateHookLora" not in nodes.NODE_CLASS_MAPPINGS:
        hooks = COMFYUI_DIR / "comfy_extras" / "nodes_hooks.py"
        assert asyncio.run(nodes.load_custom_node(str(hooks), module_parent="comfy_extras"))


class Graph:
    """An API-format prompt under construction."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict] = {}

    def add(self, class_type: str, **inputs) -> list:
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": inputs}
        return [node_id, 0]


def lora_on(g: Graph, how: str, cond: list, lora: str, strength: float, window=(0.0, 1.0)) -> list:
    """`cond` with `lora` on it, ours or the core hook way (also for "accelerated": core hooks run by our
    model node)."""
    if how == "ours":
        return g.add(
            "LoraWeaveConditioningLoRA",
            conditioning=cond,
            lora_name=lora,
            strength=strength,
            start_percent=window[0],
            end_percent=window[1],
        )
    hooks = g.add("CreateHookLora", lora_name=lora, strength_model=strength, strength_clip=0.0)
    if window != (0.0, 1.0):
        kf = g.add("CreateHookKeyframe", strength_mult=0.0, start_percent=0.0)
        kf = g.add("CreateHookKeyframe", strength_mult=1.0, start_percent=window[0], prev_hook_kf=kf)
        kf = g.add("CreateHookKeyframe", strength_mult=0.0, start_percent=window[1], prev_hook_kf=kf)
        hooks = g.add("SetHookKeyframes", hooks=hooks, hook_kf=kf)
    return g.add(
        "ConditioningSetProperties", cond_NEW=cond, strength=1.0, set_cond_area="default", hooks=hooks
    )


def workflow(case: Case, kind: str, how: str, tag: str) -> dict:
    """kind: "positive" (a LoRA on the positive only), "regions" (two masked prompts, a LoRA each, the
    second's from WINDOW[0] to WINDOW[1] of the steps), "window" (the positive's LoRA in WINDOW); how:
    "core", "ours", "accelerated" (the core graph, its MODEL through our node with core_lora_hooks on) or
    "none"."""
    g = Graph()
    model = g.add("LWTestModelSource", name=f"{case.name}_model")
    if how in ("ours", "accelerated"):
        model = g.add("LoraWeaveConditioningRuntime", model=model, core_lora_hooks=how == "accelerated")
    c = {k: g.add("LWTestCond", name=f"{case.name}_{k}") for k in ("pos", "neg", "a", "b")}
    a, b = case.loras
    if kind == "regions":
        mask = {side: g.add("LWTestMask", name=f"{case.name}_{side}") for side in ("left", "right")}
        ca, cb = (
            g.add("ConditioningSetMask", conditioning=c[k], mask=mask[side], **MASK_INPUTS)
            for k, side in (("a", "left"), ("b", "right"))
        )
        if how != "none":
            ca, cb = lora_on(g, how, ca, a, 0.9), lora_on(g, how, cb, b, 1.2, WINDOW)
        positive = g.add("ConditioningCombine", conditioning_1=ca, conditioning_2=cb)
    else:
        window = WINDOW if kind == "window" else (0.0, 1.0)
        positive = c["pos"] if how == "none" else lora_on(g, how, c["pos"], a, 0.8, window)
    samples = g.add(
        "KSampler",
        model=model,
        seed=3,
        steps=STEPS,
        cfg=CFG,
        sampler_name="euler",
        scheduler="simple",
        positive=positive,
        negative=c["neg"],
        latent_image=g.add("LWTestLatent", name=f"{case.name}_latent"),
        denoise=1.0,
    )
    g.add("LWTestCapture", samples=samples, tag=tag)
    return g.nodes


def publish(case: Case, monkeypatch) -> None:
    """Put the case's model, conditionings, masks and latent where the source nodes read them."""
    monkeypatch.setitem(REGISTRY, f"{case.name}_model", case.patcher)
    for k, cond in case.conds.items():
        monkeypatch.setitem(REGISTRY, f"{case.name}_{k}", cond)
    left, right = masks(case.latent)
    monkeypatch.setitem(REGISTRY, f"{case.name}_left", left)
    monkeypatch.setitem(REGISTRY, f"{case.name}_right", right)
    monkeypatch.setitem(REGISTRY, f"{case.name}_latent", {"samples": case.latent})


class ForwardCounter:
    """Calls of the diffusion model's forward while in its `with` block (one per batched model call)."""

    def __init__(self, patcher) -> None:
        self.module = patcher.model.diffusion_model
        self.calls = 0

    def _count(self, *_) -> None:
        self.calls += 1

    def __enter__(self) -> ForwardCounter:
        self._hook = self.module.register_forward_pre_hook(self._count)
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()


class HookPatchCounter:
    """ModelPatcher.patch_hooks calls with a hook group (each one patches weights for a group, from a cached
    copy or anew) while in its `with` block."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        c = import_comfy()
        original = c.model_patcher.ModelPatcher.patch_hooks

        def counted(patcher, hooks, *args, **kwargs):
            if hooks is not None:
                self.calls += 1
            return original(patcher, hooks, *args, **kwargs)

        monkeypatch.setattr(c.model_patcher.ModelPatcher, "patch_hooks", counted)
