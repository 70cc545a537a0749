"""A BFL Flux control LoRA (Canny/Depth layout) for the tiny ComfyUI Flux, and a conditioning node that
carries the control latent, for ComfyUI's own executor.

No real control LoRA is in ../shared/realdata (no file there has `img_in` keys), so the file is written in the
released files' layout (notes key-layouts.md "BFL control LoRA"; diffusers'
`_convert_bfl_flux_control_lora_to_diffusers` reads the same names): BFL module names without a prefix,
PEFT `lora_A`/`lora_B` pairs with a `lora_B.bias` on every Linear, the q/k RMSNorm weights as full
`*_norm.scale` replacements, and `img_in.lora_A` taking twice the model's input columns (latents + control
latent). ComfyUI's `convert_lora` recognises it by `img_in.lora_A.weight` and
`single_blocks.0.norm.key_norm.scale`. Weights are seeded, at the tiny model's widths."""

from __future__ import annotations

import torch

from .comfy_sampling import flux_conditioning

RANK = 4


def _linears(depth: int, single: int) -> list[str]:
    """Every Linear a released BFL control LoRA trains, by its BFL name."""
    names = [
        "img_in",
        "txt_in",
        "time_in.in_layer",
        "time_in.out_layer",
        "vector_in.in_layer",
        "vector_in.out_layer",
        "guidance_in.in_layer",
        "guidance_in.out_layer",
        "final_layer.linear",
        "final_layer.adaLN_modulation.1",
    ]
    for i in range(depth):
        for side in ("img", "txt"):
            names += [f"double_blocks.{i}.{side}_{m}" for m in ("mod.lin", "attn.qkv", "attn.proj")]
            names += [f"double_blocks.{i}.{side}_mlp.{j}" for j in (0, 2)]
    for i in range(single):
        names += [f"single_blocks.{i}.{m}" for m in ("linear1", "linear2", "modulation.lin")]
    return names


def _norms(depth: int, single: int) -> list[str]:
    names = [
        f"double_blocks.{i}.{side}_attn.norm.{q}_norm"
        for i in range(depth)
        for side in ("img", "txt")
        for q in ("query", "key")
    ]
    return names + [f"single_blocks.{i}.norm.{q}_norm" for i in range(single) for q in ("query", "key")]


def control_lora(patcher, seed: int = 5, width_factor: float = 2.0) -> dict[str, torch.Tensor]:
    """The BFL control LoRA state dict for the ComfyUI Flux in `patcher`: `img_in` trained on
    `width_factor` times the model's input columns (2: latents + one control latent)."""
    model = patcher.model.diffusion_model
    depth, single = len(model.double_blocks), len(model.single_blocks)
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name in _linears(depth, single):
        rows, cols = model.get_submodule(name).weight.shape
        cols = int(cols * width_factor) if name == "img_in" else cols
        sd[f"{name}.lora_A.weight"] = torch.randn(RANK, cols, generator=g) * 0.1
        sd[f"{name}.lora_B.weight"] = torch.randn(rows, RANK, generator=g) * 0.1
        sd[f"{name}.lora_B.bias"] = torch.randn(rows, generator=g) * 0.01
    for name in _norms(depth, single):
        (dim,) = model.get_submodule(name).weight.shape
        sd[f"{name}.scale"] = 1.0 + torch.randn(dim, generator=g) * 0.1
    return sd


def control_conditioning(seed: int) -> list:
    """Flux CONDITIONING carrying a seeded control latent (`concat_latent_image`, 16 channels, as ComfyUI's
    InstructPixToPix-style nodes set it): ComfyUI's Flux concatenates it when `img_in` takes the extra
    columns."""
    cond = flux_conditioning(seed)
    g = torch.Generator().manual_seed(100 + seed)
    cond[0][1]["concat_latent_image"] = torch.randn(1, 16, 2, 2, generator=g)
    return cond


class TestFluxControlConditioning:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0})}}

    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "run"
    CATEGORY = "loraweave_test"

    def run(self, seed):
        return (control_conditioning(seed),)


def control_prompt(prompt: dict) -> dict:
    """A sampling_prompt whose positive and negative conditioning carry the control latent."""
    for name in ("pos", "neg"):
        prompt[name]["class_type"] = "LWTestFluxControlConditioning"
    return prompt
