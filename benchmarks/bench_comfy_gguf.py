"""Per-step time of a GGUF Flux in ComfyUI with one LoRA: loraweave (auto = runtime) against core's
LoraLoader on ComfyUI-GGUF (its patch list, re-dequantized and re-patched by GGMLOps at every forward), and
no LoRA; peak RSS of each. CPU, ComfyUI v0.19.3 (LORAWEAVE_COMFYUI=latest for the newest tree), in process.

The model: Flux.1-dev widths (hidden 3072, 24 heads, context 4096, vector 768), `--double` double and
`--single` single blocks (default 1 + 1), written by gguf.GGUFWriter in `--qtype` (Q4_0 default; Q8_0; Q4_K
and Q5_K through the tests' packer) and loaded by ComfyUI-GGUF's UnetLoaderGGUF. The LoRA: kohya-style
rank-16 factors on every block Linear. A step: one forward of the diffusion model (1 x 16 x 32 x 32 latent,
256 image tokens, 64 text tokens) with the model loaded by ComfyUI's model management. Each case runs in its
own child process (peak RSS per case); the table shows medians over `--steps` steps after one warm-up, and the
ratios against the no-LoRA step of the same run; then one more process runs the three cases alternating
step by step on one base model (paired ratios, less at the mercy of a shared host's slow spells).
Target (issue 38): ours ≤ 1.10x the no-LoRA step, below core's.

    .venv/bin/python benchmarks/bench_comfy_gguf.py [--double 1] [--single 1] [--qtype Q4_0] [--steps 5]
        [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402  (re-executes with the malloc settings before torch is imported)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

CASES = ("none", "ours", "core")
INTERLEAVED = "interleaved"
RANK = 16


def flux_params(args) -> dict:
    return {
        "hidden_size": 3072,
        "num_heads": 24,
        "context_in_dim": 4096,
        "vec_in_dim": 768,
        "depth": args.double,
        "depth_single_blocks": args.single,
    }


def write_model(args, directory: Path) -> Path:
    from helpers import comfy_gguf as cg

    state = cg.flux_state_dict_gguf(0, **flux_params(args))
    path = directory / "flux.gguf"
    cg.write_gguf(path, state, "flux", cg.one_type(args.qtype))
    return path


def lora_for(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd = {}
    for name, m in model.model.diffusion_model.named_modules():
        if isinstance(m, torch.nn.Linear) and "blocks" in name:
            stem = f"diffusion_model.{name}"
            sd[f"{stem}.lora_down.weight"] = torch.randn(RANK, m.in_features, generator=g) * 0.02
            sd[f"{stem}.lora_up.weight"] = torch.randn(m.out_features, RANK, generator=g) * 0.02
            sd[f"{stem}.alpha"] = torch.tensor(float(RANK))
    return sd


def patched(c, model, case: str):
    """`model` with one LoRA loaded as `case` says (none, ours = loraweave auto, core = LoraLoader)."""
    if case == "none":
        return model
    sd = lora_for(model)
    if case == "ours":
        from loraweave.comfy import load_lora_for_models

        out, _, report = load_lora_for_models(model, None, sd, 1.0, 0.0)
        assert report.mode == "runtime" and report.keys_applied == report.keys_total
        return out
    return c.sd.load_lora_for_models(model, None, sd, 1.0, 0.0)[0]


def step(dm) -> float:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 32, 32, generator=g)
    ctx = torch.randn(1, 64, 4096, generator=g)
    y = torch.randn(1, 768, generator=g)
    t0 = time.perf_counter()
    with torch.no_grad():
        dm(x, torch.tensor([0.7]), ctx, y=y, guidance=torch.tensor([3.5]))
    return time.perf_counter() - t0


def interleaved(path: Path, steps: int) -> dict:
    """Step times of the three cases on one base model in one process, alternating each round (a shared
    host's slow spells hit every case alike): {case: [seconds]} after one warm-up round."""
    from helpers import comfy_gguf as cg
    from helpers.comfy_env import import_comfy

    c = import_comfy()
    base = cg.load_gguf(path)
    models = {case: patched(c, base, case) for case in CASES}
    times: dict[str, list[float]] = {case: [] for case in CASES}
    for round_ in range(steps + 1):
        for case in CASES:
            c.model_management.load_models_gpu([models[case]])
            seconds = step(models[case].model.diffusion_model)
            if round_:
                times[case].append(seconds)
    return times


def child(case: str, path: Path, steps: int) -> dict:
    from helpers import comfy_gguf as cg
    from helpers.comfy_env import import_comfy

    c = import_comfy()
    model = patched(c, cg.load_gguf(path), case)
    c.model_management.load_models_gpu([model])
    dm = model.model.diffusion_model
    times = []
    with cg.CallCounter() as counter:
        for _ in range(steps + 1):
            times.append(step(dm))
    return {
        "case": case,
        "step_s": statistics.median(times[1:]),
        "patches_per_step": counter.patch / (steps + 1),
        "dequant_per_step": counter.dequantize / (steps + 1),
        "peak_rss_mib": benchutil.peak_rss_mib(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--double", type=int, default=1)
    ap.add_argument("--single", type=int, default=1)
    ap.add_argument("--qtype", default="Q4_0")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--case", choices=(*CASES, INTERLEAVED))
    ap.add_argument("--model")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.case == INTERLEAVED:
        print(json.dumps(interleaved(Path(args.model), args.steps)))
        return
    if args.case:
        print(json.dumps(child(args.case, Path(args.model), args.steps)))
        return
    benchutil.header(f"GGUF Flux ({args.qtype}, {args.double}+{args.single} blocks) per step, one LoRA")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = write_model(args, Path(tmp))
        print(f"wrote {path.stat().st_size / 2**20:.0f} MiB GGUF in {time.perf_counter() - t0:.0f} s")
        results = {}
        for case in (*CASES, INTERLEAVED):
            cmd = [sys.executable, __file__, "--case", case, "--model", str(path), "--steps", str(args.steps)]
            cmd += ["--threads", str(args.threads)] if args.threads else []
            out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, check=True).stdout
            results[case] = json.loads(out.strip().splitlines()[-1])
    alternating = results.pop(INTERLEAVED)
    base = results["none"]["step_s"]
    rows = [
        [
            case,
            f"{r['step_s'] * 1000:.0f}",
            f"{r['step_s'] / base:.3f}x",
            f"{r['patches_per_step']:.0f}",
            f"{r['dequant_per_step']:.0f}",
            f"{r['peak_rss_mib']:.0f}",
        ]
        for case, r in results.items()
    ]
    headers = ["case", "step ms (median)", "vs no LoRA", "patches/step", "dequantize/step", "peak RSS MiB"]
    print("one process per case:")
    print(benchutil.table(headers, rows))
    print("one process, the cases alternating each step (medians of per-round ratios to the no-LoRA step):")
    rounds = list(zip(*(alternating[case] for case in CASES), strict=True))
    rows = [
        [
            case,
            f"{statistics.median(alternating[case]) * 1000:.0f}",
            f"{statistics.median(r[i] / r[0] for r in rounds):.3f}x",
        ]
        for i, case in enumerate(CASES)
    ]
    print(benchutil.table(["case", "step ms (median)", "vs no LoRA (paired)"], rows))


if __name__ == "__main__":
    main()
