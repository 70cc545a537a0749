"""Tiny inputs for every CLI command that writes a file: a Flux component folder and single file, a tuned
copy, a diffusers-named LoRA on it, and a tiny SD1.5 pipeline for `generate` (all seeded, all offline)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraweave.tools.tiny_pipeline import tiny_sd15

from .tiny_models import tiny_flux


@dataclass
class CliInputs:
    folder: Path  # diffusers component folder (config.json + weights)
    single: Path  # the same weights as one .safetensors file, config.json beside it
    tuned: Path  # single file with other seeded weights (extract's TUNED)
    lora: Path  # diffusers-named LoRA on two attention projections
    pipeline: Path | None = None  # tiny SD1.5 pipeline folder (generate)
    sd_lora: Path | None = None  # kohya LoRA on the pipeline's UNet attention


def flux_lora(model, seed: int = 1, rank: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_out"):
        layer = model.get_submodule(name)
        out[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=g) * 0.3
        out[f"transformer.{name}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=g) * 0.3
    return out


def sd_lora(pipe_dir: Path, path: Path) -> Path:
    """A kohya LoRA on every attention Linear of the pipeline's UNet."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(pipe_dir / "unet", local_files_only=True)
    g = torch.Generator().manual_seed(5)
    sd = {}
    for name, module in unet.named_modules():
        if isinstance(module, torch.nn.Linear) and "attentions" in name:
            stem = "lora_unet_" + name.replace(".", "_")
            sd[f"{stem}.lora_down.weight"] = torch.randn(2, module.in_features, generator=g) * 0.3
            sd[f"{stem}.lora_up.weight"] = torch.randn(module.out_features, 2, generator=g) * 0.3
    save_file(sd, path)
    return path


def cli_inputs(root: Path, pipeline: bool = False) -> CliInputs:
    """Everything under `root/inputs` (so that an output folder elsewhere in `root` holds no input)."""
    where = root / "inputs"
    where.mkdir(parents=True)
    model = tiny_flux(seed=3)
    model.save_pretrained(where / "transformer", safe_serialization=True)
    config = json.dumps(dict(model.config) | {"_class_name": "FluxTransformer2DModel"})
    (where / "single").mkdir()
    save_file(model.state_dict(), where / "single" / "flux.safetensors")
    (where / "single" / "config.json").write_text(config)
    tuned = {k: v.clone() for k, v in model.state_dict().items()}
    tuned["transformer_blocks.0.attn.to_q.weight"] += 0.01  # one layer differs: extract has one SVD to do
    save_file(tuned, where / "single" / "tuned.safetensors")
    save_file(flux_lora(model), where / "lora.safetensors")
    inputs = CliInputs(
        where / "transformer",
        where / "single" / "flux.safetensors",
        where / "single" / "tuned.safetensors",
        where / "lora.safetensors",
    )
    if pipeline:
        inputs.pipeline = tiny_sd15(where / "sd15")
        inputs.sd_lora = sd_lora(inputs.pipeline, where / "sd_lora.safetensors")
    return inputs
