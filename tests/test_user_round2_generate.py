"""Issue 30, a new user's second run-through: regions on a pipeline (item 2), the PNG's `Model hash` of a
folder model (item 15), `generate` tried offline from the README (item 17)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import loraweave
from loraweave.cli import main
from loraweave.tools.infotext import model_hash, parse_infotext
from loraweave.tools.tiny_pipeline import sample_lora, tiny_sd15

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def test_demo_generate_writes_the_png_apply_by_hand_gives(tmp_path, capsys):
    """`loraweave demo --generate PNG --out DIR`: the tiny pipeline and sample LoRA it leaves in DIR, run by
    hand with diffusers and loraweave.apply, give the same pixels."""
    from diffusers import StableDiffusionPipeline

    png, work = tmp_path / "demo.png", tmp_path / "work"
    assert main(["demo", "--generate", str(png), "--out", str(work)]) == 0
    printed = capsys.readouterr().out
    assert f"image: {png}" in printed
    prompt, _, params = parse_infotext(Image.open(png).text["parameters"])
    assert (
        prompt == "a cat <lora:demo:1>"
        and params["Lora hashes"].startswith("demo: ")
        and "keys_applied=132/132" in params["Loraweave"]
    )
    assert (params["Steps"], params["Seed"], params["Size"]) == ("8", "7", "64x64")

    pipe = StableDiffusionPipeline.from_pretrained(work / "pipeline", local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    loraweave.apply(pipe, work / "loras" / "demo.safetensors")
    image = pipe(
        prompt="a cat",
        negative_prompt="blurry",
        num_inference_steps=8,
        guidance_scale=5.0,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(7),
    ).images[0]
    assert np.array_equal(_pixels(png), np.asarray(image.convert("RGB")).astype(np.int16))

    assert main(["demo", "--generate", str(png)]) == 2  # an existing image is never replaced
    assert "exists" in capsys.readouterr().err


RANK, ALPHA = 4, 2.0  # sample_lora's


@pytest.fixture(scope="module")
def sd15(tmp_path_factory):
    """The tiny SD1.5 pipeline folder and a LoRA on its UNet attention and text-encoder q/v projections."""
    from diffusers import StableDiffusionPipeline

    root = tmp_path_factory.mktemp("region")
    pipe_dir = tiny_sd15(root / "pipe")
    lora = sample_lora(
        StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True), root / "r.safetensors"
    )
    return pipe_dir, lora


def _pipe(pipe_dir: Path):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _merge_by_hand(pipe, lora: Path, unet_strength: float, te_strength: float) -> None:
    """W += s * alpha/rank * up @ down, in fp64, for every kohya key of the file (its stems are the live
    names)."""
    from safetensors.torch import load_file

    tensors = load_file(lora)
    for prefix, root, strength in (
        ("lora_unet_", pipe.unet, unet_strength),
        ("lora_te_", pipe.text_encoder, te_strength),
    ):
        for name, module in root.named_modules():
            stem = prefix + name.replace(".", "_")
            if f"{stem}.lora_down.weight" not in tensors:
                continue
            up, down = (
                tensors[f"{stem}.lora_up.weight"].double(),
                tensors[f"{stem}.lora_down.weight"].double(),
            )
            delta = strength * float(tensors[f"{stem}.alpha"]) / RANK * (up @ down)
            with torch.no_grad():
                module.weight.copy_((module.weight.double() + delta).float())


def _latents(pipe, mask_shape=(64, 64)) -> torch.Tensor:
    return pipe(
        prompt="a cat",
        num_inference_steps=3,
        guidance_scale=5.0,
        height=mask_shape[0],
        width=mask_shape[1],
        output_type="latent",
        generator=torch.Generator().manual_seed(7),
    ).images


def test_region_on_a_pipeline_with_text_encoder_parts(sd15):
    """set_region then pipe(...): the text encoder (called with (1, 77) token ids) takes max(mask), the UNet
    the region. RegionError 'got (1, 77)' before. References: the LoRA merged by hand in fp64 at those
    strengths."""
    pipe_dir, lora = sd15
    half = torch.zeros(64, 64)
    half[:, :32] = 1.0  # peak 1: the text encoder keeps the full adapter

    pipe = _pipe(pipe_dir)
    handle = loraweave.apply(pipe, lora, mode="runtime")
    name = next(iter(handle.strengths))
    handle.set_region(name, half)
    embeds = pipe.encode_prompt("a cat", "cpu", 1, False)[0]
    regional = _latents(pipe)

    by_hand = _pipe(pipe_dir)
    _merge_by_hand(by_hand, lora, unet_strength=0.0, te_strength=float(half.max()))
    want = by_hand.encode_prompt("a cat", "cpu", 1, False)[0]
    assert torch.allclose(embeds, want, rtol=0, atol=2e-5), (embeds - want).abs().max()

    # A uniform mask c is strength c everywhere: text encoder and UNet (every token of every resolution).
    handle.set_region(name, torch.full((64, 64), 0.25))
    uniform = _latents(pipe)
    by_hand = _pipe(pipe_dir)
    _merge_by_hand(by_hand, lora, unet_strength=0.25, te_strength=0.25)
    want = _latents(by_hand)
    assert torch.allclose(uniform, want, rtol=0, atol=1e-4), (uniform - want).abs().max()

    # The half mask acts on the UNet: its latents are neither the adapter's nor the base's.
    handle.clear_region(name)
    full = _latents(pipe)
    assert (regional - full).abs().max() > 1e-3 and (regional - _latents(_pipe(pipe_dir))).abs().max() > 1e-3


def test_folder_model_hash_written_into_the_png(sd15, tmp_path):
    """A1111's `Model hash` (sha256 of the checkpoint, 10 hex) was never written for a pipeline folder: it is
    now the sha256 of the denoiser's weight files end to end, as the README says."""
    pipe_dir, _ = sd15
    out = tmp_path / "x.png"
    flags = "--steps 1 -W 32 -H 32".split()
    assert main(["generate", "--model", str(pipe_dir), "-p", "a cat", "-o", str(out), *flags]) == 0
    _, _, params = parse_infotext(Image.open(out).text["parameters"])
    unet = (pipe_dir / "unet" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert params["Model hash"] == hashlib.sha256(unet).hexdigest()[:10]


def test_folder_hash_covers_every_denoiser_shard_and_follows_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("LORAWEAVE_CACHE", str(tmp_path / "cache"))
    shards = [tmp_path / "pipe" / "transformer" / f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    shards[0].parent.mkdir(parents=True)
    (tmp_path / "pipe" / "text_encoder").mkdir()
    (tmp_path / "pipe" / "text_encoder" / "model.safetensors").write_bytes(b"not hashed")
    for i, shard in enumerate(shards):
        shard.write_bytes(bytes([i + 1]) * 5000)
    whole = hashlib.sha256(shards[0].read_bytes() + shards[1].read_bytes()).hexdigest()[:10]
    assert model_hash(tmp_path / "pipe") == whole
    assert model_hash(tmp_path / "pipe") == whole  # from the cache
    shards[1].write_bytes(b"changed")
    os.utime(shards[1], ns=(0, 10**9))  # a new size and mtime: hashed again
    assert (
        model_hash(tmp_path / "pipe") == hashlib.sha256(shards[0].read_bytes() + b"changed").hexdigest()[:10]
    )
    assert model_hash(tmp_path / "empty-folder-does-not-exist") is None
