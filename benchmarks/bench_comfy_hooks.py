"""LoRAs per conditioning inside ComfyUI: loraweave's conditioning LoRAs against core hooks, on a Flux-shaped
model at real width (hidden 3072, 24 heads, context 4096; default 1 double + 1 single block, fp32) on CPU,
ComfyUI v0.19.3 in process (LORAWEAVE_COMFYUI=latest: the newest tree).

Two workflows, KSampler euler/simple, CFG 2 (the negative runs), 16x16 latent (64 image tokens, 16 text):
  positive  one LoRA (A) on the positive prompt only
  regions   two masked prompts (left/right halves), LoRA A on one, LoRA B on the other
Three cases each, every (workflow, case) in its own child process (peak RSS per case):
  none      the same graph without LoRAs (hook-free batching: one model call per step)
  core      comfy.hooks.create_hook_lora + set_hooks_for_conditioning (what CreateHookLora + Cond Set Props
            do; one model call per hook group per step, weights patched per group)
  ours      loraweave.comfy.conditioning_lora on the conds + conditioning_runtime on the MODEL
LoRA files: kohya, rank 16, every Linear of every block (bench_comfy.write_loras).

Per case: one warm sampling run (loads, builds, caches), then `--runs` timed runs; printed: seconds per step
(wall median, and process CPU seconds per step: on a shared host wall counts the waits for a core), model
calls per step, peak RSS over the timed runs above the RSS with the model built, and the process's peak RSS.
Ratios: ours and core against none, in the same run. Target (issue 40): positive-only ours <= 1.15x none.

    .venv/bin/python benchmarks/bench_comfy_hooks.py [--double 1] [--single 1] [--rank 16] [--steps 2]
        [--runs 2] [--threads N (default: torch's default)]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402  (re-executes with the malloc settings before torch is imported)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bench_comfy  # noqa: E402  (the real-width Flux and its LoRA files)
import torch  # noqa: E402

WORKFLOWS = ("positive", "regions")
CASES = ("none", "core", "ours")
TOKENS = 16
STRENGTHS = {"a": 0.9, "b": 0.7}


def conds(params: dict) -> dict[str, list]:
    g = torch.Generator().manual_seed(5)

    def one() -> list:
        extra = {"pooled_output": torch.randn(1, params["vec_in_dim"], generator=g), "guidance": 3.5}
        return [[torch.randn(1, TOKENS, params["context_in_dim"], generator=g), extra]]

    return {"pos": one(), "neg": one(), "a": one(), "b": one()}


def graph(case: str, workflow: str, model, c: dict, paths: dict[str, str]):
    """(model, positive) of one case: LoRA A on the positive, or A and B on two masked prompts."""
    import comfy.hooks
    import comfy.utils

    from loraweave.comfy import conditioning_lora, conditioning_runtime

    def lora_on(cond: list, name: str) -> list:
        if case == "core":
            sd = comfy.utils.load_torch_file(paths[name], safe_load=True)
            hooks = comfy.hooks.create_hook_lora(sd, STRENGTHS[name], 0.0)
            return comfy.hooks.set_hooks_for_conditioning(cond, hooks)
        return conditioning_lora(cond, paths[name], STRENGTHS[name])

    model = conditioning_runtime(model) if case == "ours" else model
    if workflow == "positive":
        return model, c["pos"] if case == "none" else lora_on(c["pos"], "a")
    left = torch.zeros(1, 16, 16)
    left[..., :8] = 1.0
    regions = []
    for key, name, mask in (("a", "a", left), ("b", "b", 1.0 - left)):
        cond = comfy.hooks.set_mask_for_conditioning(c[key], mask, "default", 1.0)
        regions += cond if case == "none" else lora_on(cond, name)
    return model, regions


def child(case: str, workflow: str, folder: Path, params: dict, steps: int, runs: int) -> dict:
    from helpers.comfy_env import import_comfy

    import_comfy()
    import nodes

    base = bench_comfy.build_model(params)
    rss_model = bench_comfy.trimmed_rss_mib()
    c = conds(params)
    paths = {n: str(folder / f"{n}.safetensors") for n in ("a", "b")}
    calls = [0]
    base.model.diffusion_model.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))
    model, positive = graph(case, workflow, base, c, paths)
    latent = {"samples": torch.zeros(1, 16, 16, 16)}

    def run() -> None:
        nodes.common_ksampler(model, 0, steps, 2.0, "euler", "simple", positive, c["neg"], latent)

    t0 = time.perf_counter()
    run()
    first_s = time.perf_counter() - t0
    calls[0] = 0
    walls, cpus = [], []
    with benchutil.PeakRss() as peak:
        for _ in range(runs):
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            walls.append((time.perf_counter() - t0) / steps)
            cpus.append((time.process_time() - c0) / steps)
    return {
        "case": case,
        "workflow": workflow,
        "first_s": first_s,
        "step_s": benchutil.median(walls),
        "step_cpu_s": benchutil.median(cpus),
        "calls_per_step": calls[0] / (runs * steps),
        "peak_delta_mib": peak.delta_mib,
        "peak_mib": benchutil.peak_rss_mib(),
        "rss_model_mib": rss_model,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--double", type=int, default=1)
    ap.add_argument("--single", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("CASE", "WORKFLOW"))
    ap.add_argument("--dir")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    params = bench_comfy.flux_params(args.double, args.single)
    if args.child:
        case, workflow = args.child
        print(json.dumps(child(case, workflow, Path(args.dir), params, args.steps, args.runs)))
        return
    benchutil.header(
        f"conditioning LoRAs vs core hooks: Flux hidden 3072, {args.double} double + {args.single} single "
        f"blocks, rank {args.rank}, {args.steps} steps x {args.runs} runs, CFG 2, "
        f"ComfyUI {os.environ.get('LORAWEAVE_COMFYUI', 'v0.19.3')}"
    )
    records: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bench_comfy.write_loras(Path(tmp), bench_comfy.flux_shapes(params), args.rank)
        for workflow in WORKFLOWS:
            for case in CASES:
                cmd = [sys.executable, __file__, "--child", case, workflow, "--dir", tmp]
                cmd += ["--double", str(args.double), "--single", str(args.single), "--rank", str(args.rank)]
                cmd += ["--steps", str(args.steps), "--runs", str(args.runs), "--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, check=True)
                records[workflow, case] = json.loads(out.stdout.strip().splitlines()[-1])
                print(json.dumps(records[workflow, case]), flush=True)
    rows = []
    for (workflow, case), r in records.items():
        none = records[workflow, "none"]
        rows.append(
            [
                f"{workflow} {case}",
                f"{r['step_s']:.2f}",
                f"{r['step_s'] / none['step_s']:.2f}x",
                f"{r['step_cpu_s']:.2f}",
                f"{r['step_cpu_s'] / none['step_cpu_s']:.2f}x",
                f"{r['calls_per_step']:g}",
                f"{r['peak_delta_mib']:.0f}",
                f"{r['peak_mib']:.0f}",
                f"{r['first_s']:.1f}",
            ]
        )
    heads = ["case", "s/step", "vs none", "cpu s/step", "vs none", "calls/step", "peak +MiB", "peak MiB"]
    print(benchutil.table([*heads, "first run s"], rows))


if __name__ == "__main__":
    main()
