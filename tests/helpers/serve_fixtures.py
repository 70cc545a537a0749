"""A tiny SD1.5 pipeline and a store of seeded LoRAs for the serving tests (offline, seconds to build)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from loraweave.serve.engine import Engine
from loraweave.tools.tiny_pipeline import sample_lora, tiny_sd15

SETTINGS = {"steps": 3, "cfg": 5.0, "width": 32, "height": 32, "negative": "blurry"}


def lora_file(pipe, path: Path, seed: int, te: bool = True) -> Path:
    """A kohya LoRA (rank 4, alpha 2) on the UNet's attention Linears (and the TE's q/v projections)."""
    return sample_lora(pipe, path, seed, text_encoder=te)


def locon_file(pipe, path: Path, seed: int) -> Path:
    """A kohya LoCon (rank 4, alpha 2) on the UNet resnets' 3x3 convolutions: a conv-only adapter."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, module in pipe.unet.named_modules():
        if isinstance(module, torch.nn.Conv2d) and "resnets" in name and module.kernel_size == (3, 3):
            stem = "lora_unet_" + name.replace(".", "_")
            sd[f"{stem}.lora_down.weight"] = torch.randn(4, module.in_channels, 3, 3, generator=g) * 0.1
            sd[f"{stem}.lora_up.weight"] = torch.randn(module.out_channels, 4, 1, 1, generator=g) * 0.1
            sd[f"{stem}.alpha"] = torch.tensor(2.0)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, path, metadata={"ss_network_module": "networks.lora"})
    return path


def wrong_arch_file(path: Path) -> Path:
    """An SDXL-shaped LoRA: its keys name layers the tiny SD1.5 UNet does not have."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stem = "lora_unet_output_blocks_5_1_transformer_blocks_9_attn2_to_k"
    save_file(
        {f"{stem}.lora_down.weight": torch.ones(4, 2048), f"{stem}.lora_up.weight": torch.ones(640, 4)}, path
    )
    return path


def build(root: Path, adapters: int = 5) -> tuple[Path, Path]:
    """(pipeline folder, LoRA folder with a0..a{n-1}, te-less `styles/u`, conv-only `conv/c`, and
    `bad/sdxl`)."""
    from diffusers import StableDiffusionPipeline

    pipe_dir = tiny_sd15(root / "pipe")
    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True)
    loras = root / "loras"
    for i in range(adapters):
        lora_file(pipe, loras / f"a{i}.safetensors", seed=10 + i)
    lora_file(pipe, loras / "styles" / "u.safetensors", seed=99, te=False)
    locon_file(pipe, loras / "conv" / "c.safetensors", seed=98)
    wrong_arch_file(loras / "bad" / "sdxl.safetensors")
    return pipe_dir, loras


def pixels(png: bytes | Path) -> np.ndarray:
    source = io.BytesIO(png) if isinstance(png, bytes) else png
    return np.asarray(Image.open(source).convert("RGB")).astype(np.int16)


def generated(
    pipe_dir: Path, loras: Path, prompt: str, seed: int, out: Path, mode: str = "auto"
) -> np.ndarray:
    """The image `loraweave generate` makes with SETTINGS (its own freshly loaded pipeline)."""
    from loraweave.tools.generate import GenerateRequest, generate

    req = GenerateRequest(
        model=str(pipe_dir),
        prompt=prompt,
        output=str(out),
        negative=SETTINGS["negative"],
        lora_dir=str(loras),
        apply_mode=mode,
        steps=SETTINGS["steps"],
        cfg=SETTINGS["cfg"],
        seed=seed,
        width=SETTINGS["width"],
        height=SETTINGS["height"],
        overwrite=True,  # the tests reuse scratch names (near.png) across cases
    )
    generate(req)
    return pixels(out)


def rendered(
    pipe_dir: Path, loras: Path, prompt: str, seed: int, copies: int = 1, floats: bool = False
) -> np.ndarray:
    """The image `loraweave generate --lora-apply-mode runtime` makes with SETTINGS (its loading, tag
    resolution and apply), from one pipeline call of `copies` identical samples: the batch size a served image
    came from (CPU kernels round by batch size: a conv of N=1 vs N>=2, a GEMM of M<4 rows vs more; never by
    what other rows hold). `floats`: the decoded float image (H, W, 3) in [0, 1] instead of the 8-bit one."""
    from loraweave.api import apply
    from loraweave.tools.generate import GenerateRequest, adapter_specs, load_pipeline

    req = GenerateRequest(model=str(pipe_dir), prompt=prompt, lora_dir=str(loras))
    pipe = load_pipeline(req)
    pipe.set_progress_bar_config(disable=True)
    clean, specs = adapter_specs(req)
    if specs:
        apply(pipe, specs, mode="runtime", strict=True, progress=False)
    images = pipe(
        prompt=[clean] * copies,
        negative_prompt=[SETTINGS["negative"]] * copies,
        generator=[torch.Generator("cpu").manual_seed(seed) for _ in range(copies)],
        num_inference_steps=SETTINGS["steps"],
        guidance_scale=SETTINGS["cfg"],
        width=SETTINGS["width"],
        height=SETTINGS["height"],
        output_type="np" if floats else "pil",
    ).images
    return images[0] if floats else np.asarray(images[0].convert("RGB")).astype(np.int16)


class FaultyEngine(Engine):
    """An Engine whose process dies (os._exit, as an OOM kill does) inside the UNet's first forward of a
    render that holds a prompt with `CRASH`, while `<lora_dir>/../crash.arm` exists; the file holds the deaths
    left."""

    def _render(self, reqs):
        arm = self.store.root.parent / "crash.arm"
        if any("CRASH" in r.prompt for r in reqs) and arm.exists():
            left = int(arm.read_text()) - 1
            if left > 0:
                arm.write_text(str(left))
            else:
                arm.unlink()
            self.pipe.unet.register_forward_pre_hook(lambda *_: os._exit(1))
        return super()._render(reqs)
