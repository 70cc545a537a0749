"""Issue 30, a new user's second run-through: `generate` tried offline from the README (item 17)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import loraweave
from loraweave.cli import main
from loraweave.tools.infotext import parse_infotext

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def test_demo_generate_writes_the_png_apply_by_hand_gives(tmp_path, capsys):
    """`loraweave demo --generate PNG --out DIR`: the tiny pipeline and sample LoRA it leaves in DIR, run by hand
    with diffusers and loraweave.apply, give the same pixels."""
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
