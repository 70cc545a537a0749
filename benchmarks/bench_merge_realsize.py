"""Merge at real Flux size: four bf16 Linear(15360, 3072) layers (Flux's single-block proj_out, BFL `linear2`)
and a rank-16 kohya LoRA at the shapes of a real Flux LoRA's header (../shared/realdata/keys/invokeai/
flux_lora_kohya_format.json: down (16, 15360), up (3072, 16), alpha; the tensors are seeded, bf16, ‖ΔW‖ ≈ 2 %
of ‖W‖). Issue 39's real-size case: apply, strength change and remove, default undo ("auto") and
undo="copy", and the same file with one up column set to 65504 (a fuzzed but legal file: most elements miss).

Each thread count (`--threads`, default 1 and torch's default) is timed in wall seconds, round-robin over
--rounds rounds, medians; `--load N` runs N busy processes beside the whole run. Every round checks that
remove() restores the weights bit for bit.

    .venv/bin/python benchmarks/bench_merge_realsize.py [--rounds 3] [--threads 1,default] [--load N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import median, table

LAYERS, OUT, IN, RANK, ALPHA = 4, 3072, 15360, 16, 16.0
CASES = (("auto", "lora"), ("copy", "lora"), ("auto", "65504"), ("copy", "65504"))


def build() -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    blocks = torch.nn.ModuleList()
    for _ in range(LAYERS):
        block = torch.nn.Module()
        with torch.device("meta"):
            block.linear2 = torch.nn.Linear(IN, OUT, dtype=torch.bfloat16)
        block.to_empty(device="cpu")
        with torch.no_grad():
            block.linear2.weight.copy_(torch.randn(OUT, IN, generator=g) * IN**-0.5)
            block.linear2.bias.zero_()
        blocks.append(block)
    model = torch.nn.Module()
    model.single_blocks = blocks
    return model


def write_lora(model: torch.nn.Module, path: str, big: bool) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    sd = {}
    for i, block in enumerate(model.single_blocks):
        down = torch.randn(RANK, IN, generator=g)
        up = torch.randn(OUT, RANK, generator=g)
        w = block.linear2.weight.float()
        up *= 0.02 * w.norm() / ((ALPHA / RANK) * (up @ down).norm())
        if big:
            up[:, 0] = 65504.0
        key = f"lora_unet_single_blocks_{i}_linear2"
        sd[f"{key}.lora_down.weight"] = down.to(torch.bfloat16)
        sd[f"{key}.lora_up.weight"] = up.to(torch.bfloat16)
        sd[f"{key}.alpha"] = torch.tensor(ALPHA)
    save_file(sd, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=benchutil.positive_int, default=3)
    ap.add_argument("--threads", type=benchutil.thread_counts, default="1,default")
    benchutil.add_load_arg(ap)
    args = ap.parse_args()
    benchutil.setup_torch()
    benchutil.header(f"bench_merge_realsize: {LAYERS} x bf16 ({OUT}, {IN}), rank-{RANK} kohya Flux LoRA")
    import loraweave

    model = build()
    pristine = [b.linear2.weight.detach().clone() for b in model.single_blocks]
    tmp = tempfile.TemporaryDirectory(prefix="lw_bench_realsize_")
    files = {name: os.path.join(tmp.name, f"{name}.safetensors") for name in ("lora", "65504")}
    for name, path in files.items():
        write_lora(model, path, name == "65504")
    times: dict[tuple[int, str, str, str], list[float]] = {}
    kinds: dict[tuple[str, str], str] = {}
    with benchutil.BackgroundLoad(args.load) as load, torch.no_grad():
        print(load.line())
        for r in range(args.rounds + 1):  # round 0: one warm-up case (kernel build, imports), not counted
            for threads in args.threads if r else args.threads[:1]:
                torch.set_num_threads(threads)
                for undo, name in CASES if r else CASES[:1]:
                    t0 = time.perf_counter()
                    h = loraweave.apply(model, files[name], mode="merge", undo=undo, strict=True)
                    t1 = time.perf_counter()
                    h.set_strength(next(iter(h.strengths)), 0.5)
                    t2 = time.perf_counter()
                    h.remove()
                    t3 = time.perf_counter()
                    kinds[(undo, name)] = ",".join(sorted({m.undo for m in h.report.applied}))
                    assert all(
                        torch.equal(b.linear2.weight, p)
                        for b, p in zip(model.single_blocks, pristine, strict=True)
                    ), "remove() did not restore the weights"
                    if r:
                        for step, t in (("apply", t1 - t0), ("strength", t2 - t1), ("remove", t3 - t2)):
                            times.setdefault((threads, undo, name, step), []).append(t)
        print(load.line())
    rows = []
    for undo, name in CASES:
        for step in ("apply", "strength", "remove"):
            cells = [f"{median(times[(t, undo, name, step)]):.2f}" for t in args.threads]
            one = median(times[(args.threads[0], undo, name, step)])
            ratios = [f"{median(times[(t, undo, name, step)]) / one:.2f}x" for t in args.threads[1:]]
            rows.append([f"{name} undo={undo} ({kinds[(undo, name)]})", step, *cells, *ratios])
    heads = [f"{t} thr s" for t in args.threads] + [f"{t} thr / {args.threads[0]}" for t in args.threads[1:]]
    print(f"cpu={benchutil.cpu_model()!r}  --load {args.load}  medians of {args.rounds} rounds (wall)")
    print(table(["file, undo (record kept)", "step", *heads], rows))
    tmp.cleanup()


if __name__ == "__main__":
    main()
