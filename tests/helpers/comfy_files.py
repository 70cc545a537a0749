"""Seeded adapter files for the tiny ComfyUI models (comfy_models.py), in the layouts trainers write: kohya on
diffusers names, diffusers, PEFT, original names (ldm / BFL, kohya or `diffusion_model.` spelled), the
layouts ComfyUI drops (diffusers `.lora.down`, attention processors, PEFT `base_model.model.` Flux,
XLabs Flux), and kohya text-encoder keys. Factors come from helpers.arch_matrix.factors (one per family)."""

from __future__ import annotations

import torch

from .arch_matrix import factors

FAMILIES = ("lora", "lokr", "loha", "dora", "oft")
# (module name filter) the tiny models' linears a file targets: attention, feed-forward and fused projections.
TARGET_WORDS = ("attn", "ff", "mlp", "linear1", "linear2", "to_", "proj")
PEFT_ROLES = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}


def target_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(w in n for w in TARGET_WORDS) and "norm" not in n
    }


def _write(sd: dict, stem: str, tensors: dict[str, torch.Tensor], peft: bool) -> None:
    for suffix, tensor in tensors.items():
        if peft:
            if suffix == "alpha":
                continue  # PEFT files carry no alpha (scale 1)
            suffix = PEFT_ROLES[suffix]
        sd[f"{stem}.{suffix}"] = tensor


def boft_factors(out: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """LyCORIS BOFT on `out` rows: 2 butterfly stages of 4 x 4 blocks (1 stage where out/4 is odd); no
    constraint."""
    b = 4 if out % 4 == 0 else 2
    stages = 2 if (out // b) % 2 == 0 else 1
    return {"oft_blocks": torch.randn(stages, out // b, b, b, generator=g) * 0.2, "alpha": torch.tensor(0.0)}


def adapter_file(
    modules: dict[str, torch.nn.Module], family: str, stem_of, peft: bool = False, seed: int = 3
):
    """{key: tensor}: one `family` part per module, named `stem_of(module name)`."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, module in modules.items():
        out, inp = module.weight.shape
        made = boft_factors(out, g) if family == "boft" else factors(family, out, inp, g)
        _write(sd, stem_of(name), made, peft)
    return sd


def kohya(prefix: str):
    return lambda name: prefix + name.replace(".", "_")


def dotted(prefix: str):
    return lambda name: prefix + name


def xlabs_flux(twin: torch.nn.Module, seed: int = 5) -> dict[str, torch.Tensor]:
    """XLabs' processor LoRA on a diffusers Flux: qkv/proj for both streams of each double block, single
    qkv."""
    g = torch.Generator().manual_seed(seed)
    mods = dict(twin.named_modules())
    sd: dict[str, torch.Tensor] = {}
    pairs = (("qkv_lora1", "to_q", 3), ("qkv_lora2", "add_q_proj", 3), ("proj_lora1", "to_out.0", 1))
    for i in range(len(twin.transformer_blocks)):
        for name, live, fused in (*pairs, ("proj_lora2", "to_add_out", 1)):
            m = mods[f"transformer_blocks.{i}.attn.{live}"]
            sd[f"double_blocks.{i}.processor.{name}.down.weight"] = torch.randn(2, m.in_features, generator=g)
            sd[f"double_blocks.{i}.processor.{name}.up.weight"] = torch.randn(
                fused * m.out_features, 2, generator=g
            )
    for i in range(len(twin.single_transformer_blocks)):
        m = mods[f"single_transformer_blocks.{i}.attn.to_q"]
        sd[f"single_blocks.{i}.processor.qkv_lora.down.weight"] = torch.randn(2, m.in_features, generator=g)
        sd[f"single_blocks.{i}.processor.qkv_lora.up.weight"] = torch.randn(
            3 * m.out_features, 2, generator=g
        )
    return sd


def processor_unet(twin: torch.nn.Module, legacy_layer: bool, seed: int = 6) -> dict[str, torch.Tensor]:
    """Old diffusers UNet LoRA: `unet.<attn>.processor.to_q_lora.down.weight` (attention processors) or
    `unet.<linear>.lora.down.weight` (LoRACompatibleLinear)."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, m in target_linears(twin).items():
        attn, _, proj = name.rpartition(".")
        if proj not in ("to_q", "to_k", "to_v") and not name.endswith("to_out.0"):
            continue
        if legacy_layer:
            stem = f"unet.{name}.lora"
        else:
            attn = attn.removesuffix(".to_out") if name.endswith("to_out.0") else attn
            stem = f"unet.{attn}.processor.{'to_out' if name.endswith('to_out.0') else proj}_lora"
        sd[f"{stem}.down.weight"] = torch.randn(2, m.in_features, generator=g)
        sd[f"{stem}.up.weight"] = torch.randn(m.out_features, 2, generator=g) * 0.1
    return sd


def conv_lora(model: torch.nn.Module, prefix: str, seed: int = 8) -> dict[str, torch.Tensor]:
    """kohya LoCon on every Conv2d of `model`: a k x k down, a 1 x 1 up, alpha 1 (rank 2)."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            out, inp, kh, kw = m.weight.shape
            stem = prefix + name.replace(".", "_")
            sd[f"{stem}.lora_down.weight"] = torch.randn(2, inp, kh, kw, generator=g)
            sd[f"{stem}.lora_up.weight"] = torch.randn(out, 2, 1, 1, generator=g) * 0.1
            sd[f"{stem}.alpha"] = torch.tensor(1.0)
    return sd
