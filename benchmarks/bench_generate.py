"""`loraweave generate` overhead (load, prompt parsing, apply, PNG + metadata + sidecar) vs the plain
diffusers pipeline on the same tiny SD1.5 model (loraweave.tools.tiny_pipeline: 2-level UNet, 2-layer CLIP,
64x64, 8 steps).

Variants run round-robin in one process (one torch thread: the machine's 2 cores are shared), medians
reported:

  diffusers           from_pretrained + pipe(...) + image.save(png)
  diffusers + PEFT    the same with pipe.load_lora_weights(file) (diffusers' own kohya converter + PEFT
                      layers)
  generate            loraweave.tools.generate.generate(request) without an adapter
  generate <lora:x:1> the same with the prompt tag: parse, resolve in the folder, apply (merge), AddNet hash

    .venv/bin/python benchmarks/bench_generate.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraweave.tools.tiny_pipeline import sample_lora, tiny_sd15

STEPS, SIZE, SEED = 8, 64, 7


def make_lora(pipe_dir: Path, path: Path) -> None:
    """kohya LoRA, rank 4, on every UNet attention Linear (UNet only: diffusers' kohya converter cannot infer
    this tiny text encoder's key type)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True)
    sample_lora(pipe, path, text_encoder=False)


def plain(pipe_dir: Path, out: Path, lora: Path | None = None) -> float:
    from diffusers import StableDiffusionPipeline

    t0 = time.perf_counter()
    pipe = StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    image = pipe(
        prompt="a cat",
        negative_prompt="blurry",
        num_inference_steps=STEPS,
        guidance_scale=5.0,
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(SEED),
    ).images[0]
    image.save(out)
    return time.perf_counter() - t0


def ours(pipe_dir: Path, out: Path, lora_dir: Path | None = None) -> tuple[float, dict]:
    from loraweave.tools.generate import GenerateRequest, generate

    prompt = "a cat <lora:x:1>" if lora_dir else "a cat"
    req = GenerateRequest(
        model=str(pipe_dir),
        prompt=prompt,
        negative="blurry",
        lora_dir=str(lora_dir) if lora_dir else None,
        steps=STEPS,
        cfg=5.0,
        seed=SEED,
        width=SIZE,
        height=SIZE,
        output=str(out),
    )
    t0 = time.perf_counter()
    res = generate(req)
    return time.perf_counter() - t0, res.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    pipe_dir = tiny_sd15(tmp / "pipe")
    make_lora(pipe_dir, tmp / "loras" / "x.safetensors")
    lora = tmp / "loras" / "x.safetensors"
    variants = {
        "diffusers": lambda: plain(pipe_dir, tmp / "a.png"),
        "diffusers + PEFT": lambda: plain(pipe_dir, tmp / "b.png", lora),
        "generate": lambda: ours(pipe_dir, tmp / "c.png")[0],
        "generate <lora:x:1>": lambda: ours(pipe_dir, tmp / "d.png", tmp / "loras")[0],
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.rounds + 1):  # round 0 warms imports and caches: discarded
        names = list(variants)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            seconds = variants[name]()
            if r:
                times[name].append(seconds)
        print(f"round {r} done", file=sys.stderr)
    phases = ours(pipe_dir, tmp / "e.png", tmp / "loras")[1]
    base = statistics.median(times["diffusers"])
    print(f"{'variant':<22} {'median s':>9} {'vs diffusers':>13}")
    for name, ts in times.items():
        print(f"{name:<22} {statistics.median(ts):>9.3f} {statistics.median(ts) / base:>12.2f}x")
    print(f"generate <lora:x:1> phases (one run): {phases}")
    overhead = statistics.median(times["generate <lora:x:1>"]) - statistics.median(times["diffusers + PEFT"])
    print(
        f"generate with the LoRA vs diffusers + PEFT with the same file: {overhead * 1000:+.0f} ms per image"
    )


if __name__ == "__main__":
    main()
