"""The browser test's conditioning-LoRA workflow: a LoRA on the positive prompt only, through
LoraWeaveConditioningLoRA and LoraWeaveConditioningRuntime, sampled by KSampler on the tiny Flux. The browser
base directory has no text encoder, so a test-only custom node (written into custom_nodes) hands out the
tiny Flux's conditionings as tensors: [1, 6, 32] context, a pooled vector and the guidance."""

from __future__ import annotations

from pathlib import Path

from .comfy_pack import FLUX_FILE

COND_SOURCE = "LWBrowserCond"
NODE_SOURCE = f'''"""Test-only: the tiny Flux's CONDITIONING without a text encoder, seeded by `index`."""
import torch


class {COND_SOURCE}:
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "run"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {{"required": {{"index": ("INT", {{"default": 1, "min": 0, "max": 99}})}}}}

    def run(self, index):
        g = torch.Generator().manual_seed(index)
        context, pooled = torch.randn(1, 6, 32, generator=g), torch.randn(1, 32, generator=g)
        return ([[context, {{"pooled_output": pooled, "guidance": 3.5}}]],)


NODE_CLASS_MAPPINGS = {{"{COND_SOURCE}": {COND_SOURCE}}}
'''
COND_LORA, RUNTIME, SAMPLER, SAVE = 13, 12, 15, 17  # node ids in the workflow
STRENGTH = 0.8
SAVED_PREFIX = "latents/lw_cond"


def write_cond_source(base: Path) -> None:
    """The test-only conditioning source, as a custom node of the base directory."""
    (base / "custom_nodes" / "lw_browser_cond.py").write_text(NODE_SOURCE)


def _node(node_id: int, kind: str, pos, size, inputs, outputs, widgets) -> dict:
    return {"id": node_id, "type": kind, "pos": pos, "size": size, "flags": {}, "order": node_id, "mode": 0,
            "inputs": inputs, "outputs": outputs, "properties": {}, "widgets_values": widgets}  # fmt: skip


def _in(name: str, kind: str, link: int | None) -> dict:
    return {"name": name, "type": kind, "link": link}


def _out(name: str, kind: str, links: list[int]) -> dict:
    return {"name": name, "type": kind, "links": links}


def cond_workflow() -> dict:
    """UI-format workflow: Load Diffusion Model -> LoraWeave Conditioning Runtime -> KSampler; positive
    (source 1) -> LoraWeave Conditioning LoRA -> KSampler; negative (source 2) and an Empty SD3 latent ->
    KSampler -> Save Latent."""
    nodes = [
        _node(11, "UNETLoader", [20, 60], [320, 90], [], [_out("MODEL", "MODEL", [1])],
              [FLUX_FILE, "default"]),
        _node(RUNTIME, "LoraWeaveConditioningRuntime", [370, 60], [300, 80], [_in("model", "MODEL", 1)],
              [_out("MODEL", "MODEL", [2])], [False]),
        _node(COND_LORA, "LoraWeaveConditioningLoRA", [370, 200], [320, 160],
              [_in("conditioning", "CONDITIONING", 3)], [_out("CONDITIONING", "CONDITIONING", [4])],
              ["flux.safetensors", STRENGTH, 0.0, 1.0]),
        _node(14, COND_SOURCE, [20, 230], [300, 60], [], [_out("CONDITIONING", "CONDITIONING", [3])], [1]),
        _node(SAMPLER, "KSampler", [720, 60], [320, 270],
              [_in("model", "MODEL", 2), _in("positive", "CONDITIONING", 4),
               _in("negative", "CONDITIONING", 5), _in("latent_image", "LATENT", 6)],
              [_out("LATENT", "LATENT", [7])], [3, "fixed", 2, 2.0, "euler", "simple", 1.0]),
        _node(16, COND_SOURCE, [20, 400], [300, 60], [], [_out("CONDITIONING", "CONDITIONING", [5])], [2]),
        _node(SAVE, "SaveLatent", [1080, 60], [300, 60], [_in("samples", "LATENT", 7)], [], [SAVED_PREFIX]),
        _node(18, "EmptySD3LatentImage", [370, 480], [300, 110], [], [_out("LATENT", "LATENT", [6])],
              [32, 32, 1]),
    ]  # fmt: skip
    links = [
        [1, 11, 0, RUNTIME, 0, "MODEL"],
        [2, RUNTIME, 0, SAMPLER, 0, "MODEL"],
        [3, 14, 0, COND_LORA, 0, "CONDITIONING"],
        [4, COND_LORA, 0, SAMPLER, 1, "CONDITIONING"],
        [5, 16, 0, SAMPLER, 2, "CONDITIONING"],
        [6, 18, 0, SAMPLER, 3, "LATENT"],
        [7, SAMPLER, 0, SAVE, 0, "LATENT"],
    ]
    view = {"ds": {"scale": 0.9, "offset": [100, 90]}}  # all of it in the window
    return {"last_node_id": 18, "last_link_id": 7, "nodes": nodes, "links": links, "groups": [], "config": {},
            "extra": view, "version": 0.4}  # fmt: skip
