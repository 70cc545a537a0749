"""A full-size SDXL UNet (fp16, CPU) with a rank-32 LoRA on every Linear and Conv2d: diffusers + PEFT against
loraweave, side by side in one run, each variant in its own process.

Model: diffusers UNet2DConditionModel from the real SDXL-base config (../shared/realdata/configs; 2.57 G
parameters, 4.8 GiB fp16), built on the meta device and filled with seeded uniform values (std
1/sqrt(fan_in)). It sits in a StableDiffusionXLPipeline built from components offline: the UNet only (VAE,
text encoders, tokenizers and scheduler None: the LoRA has no text-encoder part), so the pipeline-level LoRA
calls run as users call them.
LoRAs: A and B, rank 32 on every Linear and Conv2d of the UNet (794 layers; conv down (r, in, k, k), up
(out, r, 1, 1)), synthesized at the real shapes in the keys diffusers loads (`unet.<module>.lora_A/B.weight`,
no alpha: scale 1), fp16, ‖ΔW‖ ≈ 2 % of ‖W‖; written once to a temporary folder by the parent.

Variants (one process each, glibc MALLOC_* thresholds of benchutil set; the model is built, then
malloc_trim(0), then measured):
  peft     diffusers 0.42 + PEFT: pipe.load_lora_weights(A) + pipe.fuse_lora(); strength: unfuse_lora() +
           set_adapters(A, 0.5) + fuse_lora(); swap: unfuse_lora() + unload_lora_weights() +
           load_lora_weights(B) + fuse_lora(); end: unfuse_lora() + unload_lora_weights()
  dropin   the same calls on the same pipeline after loraweave.diffusers.enable(pipe)
  merge    loraweave.apply({"unet": unet}, A, mode="merge") (default undo: exact); strength:
           handle.set_strength(A, 0.5); swap: handle.switch(B); end: handle.remove()
  runtime  loraweave.apply(..., mode="runtime"); strength: set_strength; swap: switch(B); end: remove()
Each child repeats load/strength/swap/end for --rounds rounds (median per step; the first round includes
one-time costs such as imports of PEFT). Peak RSS: growth of VmHWM over the resident size after the model was
built and trimmed (reset through /proc/self/clear_refs); "kept" is the resident growth after the end step and
malloc_trim(0). Ratios are each variant's median over peft's. A child is killed past --max-rss-gib.

    .venv/bin/python benchmarks/bench_sdxl.py [--rounds 3] [--repeats 2] [--json out.json]
        [--variants peft,dropin,merge,runtime] [--threads 1,default] [--load N] [--width-divisor 2]
`--threads` lists the torch thread counts timed in turn (default: 1 and torch's default); `--load N` runs N
busy processes beside the whole run (benchutil.BackgroundLoad).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import cpu_model, median, peak_rss_mib, reset_peak_rss, rss_mib

CONFIG = "/work/shared/realdata/configs/sdxl-base__unet_config.json"
RANK, REL = 32, 0.02
STEPS = ("load", "strength", "swap", "end")
VARIANTS = ("peft", "dropin", "merge", "runtime")


def trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def build_unet(device: str = "cpu", config_path: str = CONFIG):
    from diffusers import UNet2DConditionModel

    with open(config_path) as f:
        config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config).to(torch.float16)  # fp16 before any memory exists
    if device == "meta":
        return unet
    unet.to_empty(device=device)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in unet.parameters():
            bound = 3**0.5 * (p[0].numel() if p.dim() > 1 else 2500) ** -0.5
            p.uniform_(-bound, bound, generator=g)
    return unet.eval().requires_grad_(False)


def lora_layers(unet) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in unet.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]


def write_lora(path: str, seed: int, config_path: str) -> int:
    """A rank-32 LoRA on every Linear/Conv2d, in diffusers' PEFT keys; returns its number of layers."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    layers = lora_layers(build_unet("meta", config_path))
    for name, m in layers:
        w = m.weight
        fan_in = w[0].numel()
        down = torch.randn(RANK, *w.shape[1:], generator=g) * fan_in**-0.5
        # ΔW = up·down then has entries of std REL·fan_in**-0.5: 2 % of W's (std fan_in**-0.5)
        up = torch.randn(w.shape[0], RANK, *([1] * (w.dim() - 2)), generator=g) * (REL * RANK**-0.5)
        tensors[f"unet.{name}.lora_A.weight"] = down.to(torch.float16).contiguous()
        tensors[f"unet.{name}.lora_B.weight"] = up.to(torch.float16).contiguous()
    save_file(tensors, path)
    return len(layers)


def narrowed_config(config_path: str, divisor: int, folder: str) -> str:
    """The config with block_out_channels divided by `divisor` (same blocks and layers), written into
    `folder`."""
    with open(config_path) as f:
        config = json.load(f)
    channels = [c // divisor for c in config["block_out_channels"]]
    groups = config.get("norm_num_groups", 32)
    if any(
        c * divisor != full or c % groups
        for c, full in zip(channels, config["block_out_channels"], strict=True)
    ):
        raise SystemExit(
            f"--width-divisor {divisor}: channels {config['block_out_channels']} / {divisor} must stay whole "
            f"multiples of norm_num_groups={groups} (2 works for SDXL)"
        )
    config["block_out_channels"] = channels
    path = os.path.join(folder, "unet_config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _pipe(unet):
    from diffusers import StableDiffusionXLPipeline

    cls = StableDiffusionXLPipeline
    kwargs = dict.fromkeys(cls._get_signature_keys(cls)[0])
    return cls(**kwargs | {"unet": unet})


def _pipeline_steps(pipe, a: str, b: str) -> dict:
    def load():
        pipe.load_lora_weights(a, adapter_name="a")
        pipe.fuse_lora()

    def strength():
        pipe.unfuse_lora()
        pipe.set_adapters(["a"], [0.5])
        pipe.fuse_lora()

    def swap():
        pipe.unfuse_lora()
        pipe.unload_lora_weights()
        pipe.load_lora_weights(b, adapter_name="b")
        pipe.fuse_lora()

    def end():
        pipe.unfuse_lora()
        pipe.unload_lora_weights()

    return {"load": load, "strength": strength, "swap": swap, "end": end}


def _loraweave_steps(unet, a: str, b: str, mode: str) -> dict:
    import loraweave

    held = {}

    def load():
        held["h"] = loraweave.apply({"unet": unet}, a, mode=mode)

    def strength():
        h = held["h"]
        h.set_strength(next(iter(h.strengths)), 0.5)

    def swap():
        held["h"].switch([b])

    def end():
        held.pop("h").remove()

    return {"load": load, "strength": strength, "swap": swap, "end": end}


def child(variant: str, a: str, b: str, rounds: int, threads: int, config_path: str) -> dict:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    unet = build_unet("cpu", config_path)
    build_s = time.perf_counter() - t0
    if variant in ("peft", "dropin"):
        pipe = _pipe(unet)
        if variant == "dropin":
            import loraweave.diffusers as lwd

            lwd.enable(pipe)
        steps = _pipeline_steps(pipe, a, b)
    else:
        steps = _loraweave_steps(unet, a, b, variant)
    check = [(n, m.weight[:2].clone()) for n, m in lora_layers(unet)[::50]]
    trim()
    base = rss_mib()
    reset_peak_rss()
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    cpu: dict[str, list[float]] = {s: [] for s in STEPS}
    with torch.no_grad():
        for _ in range(rounds):
            for s in STEPS:
                t, c = time.perf_counter(), time.process_time()
                steps[s]()
                times[s].append(time.perf_counter() - t)
                cpu[s].append(time.process_time() - c)
    peak = peak_rss_mib() - base
    trim()
    kept = rss_mib() - base
    drift = max(float((unet.get_submodule(n).weight[:2].float() - w.float()).abs().max()) for n, w in check)
    return {
        "variant": variant,
        "build_s": build_s,
        "times": times,
        "cpu": cpu,
        "peak_mib": peak,
        "kept_mib": kept,
        "base_mib": base,
        "drift": drift,
    }


def run_child(variant: str, a: str, b: str, args) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--a",
        a,
        "--b",
        b,
        "--rounds",
        str(args.rounds),
        "--threads",
        str(args.threads[0]),
        "--config",
        args.config,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    limit_kb = args.max_rss_gib * 2**20
    while proc.poll() is None:
        time.sleep(1.0)
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        if rss > limit_kb:
            proc.kill()
            proc.wait()
            raise SystemExit(f"{variant}: RSS {rss / 2**20:.1f} GiB passed --max-rss-gib {args.max_rss_gib}")
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{variant}: child failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=benchutil.positive_int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--threads", type=benchutil.thread_counts, default="1,default")
    benchutil.add_load_arg(ap)
    ap.add_argument("--max-rss-gib", type=float, default=9.0)
    ap.add_argument(
        "--config", default=CONFIG, help="a UNet config (a small one: a quick check of the script)"
    )
    ap.add_argument(
        "--width-divisor",
        type=benchutil.positive_int,
        default=1,
        help="divide the config's block_out_channels by N (2: the same 794 layers at half width, ~1/4 of the "
        "elements; a run that fits a loaded host)",
    )
    ap.add_argument(
        "--repeats",
        type=benchutil.positive_int,
        default=1,
        help="run the variants N times, interleaved (peft, dropin, ..., peft, ...), each in a fresh process; "
        "medians over every round of every repeat, peak RSS the highest",
    )
    ap.add_argument("--json", help="write every child's raw result (per-round times) to this file")
    ap.add_argument("--child")
    ap.add_argument("--a")
    ap.add_argument("--b")
    args = ap.parse_args()
    thread_list = args.threads
    if args.child:
        print(json.dumps(child(args.child, args.a, args.b, args.rounds, args.threads[0], args.config)))
        return
    with benchutil.BackgroundLoad(args.load) as load:
        for threads in thread_list:
            args.threads = [threads]
            print(f"\n-- torch threads {threads}; {load.line()}")
            compare(args)


def compare(args: argparse.Namespace) -> None:
    """Every variant in its own process at the thread count args.threads[0]; the tables."""
    size = "full-size" if args.width_divisor == 1 else f"channels / {args.width_divisor}"
    print(f"== bench_sdxl: SDXL UNet fp16 ({size}), rank-{RANK} LoRA on every Linear and Conv2d")
    print(
        f"cpu={cpu_model()!r}  cpus={os.cpu_count()}  threads={args.threads}  rounds={args.rounds}  "
        f"torch {torch.__version__}"
    )
    print(benchutil.malloc_env_line())
    with tempfile.TemporaryDirectory(prefix="bench_sdxl_") as tmp:
        a, b = os.path.join(tmp, "a.safetensors"), os.path.join(tmp, "b.safetensors")
        if args.width_divisor != 1:
            args.config = narrowed_config(args.config, args.width_divisor, tmp)
        layers = write_lora(a, 1, args.config)
        write_lora(b, 2, args.config)
        print(f"LoRA: {layers} layers, {os.path.getsize(a) / 2**20:.0f} MiB per file")
        runs: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
        for rep in range(args.repeats):
            for v in runs:
                runs[v].append(r := run_child(v, a, b, args))
                print(
                    f"  {v} (repeat {rep + 1}/{args.repeats}): build {r['build_s']:.1f} s, "
                    f"base RSS {r['base_mib'] / 1024:.2f} GiB, load {os.getloadavg()[0]:.2f}, done",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "runs": runs}, f, indent=1)
    results = {v: merged(rs) for v, rs in runs.items()}
    for clock, label in (("times", "wall seconds"), ("cpu", "process CPU seconds (all threads)")):
        print(f"-- {label}")
        table(results, clock)
    print(
        "medians over rounds (and repeats); peak: VmHWM growth over the trimmed resident size after the "
        "model was built (highest over repeats); kept: resident growth after the end step and "
        "malloc_trim(0); max |W-W0|: weight drift after the end step on every 50th layer's first two rows (0 "
        "= bit-exact there)"
    )


def merged(rs: list[dict]) -> dict:
    """One variant's repeats as one record: every round's times pooled, the worst peak, kept and drift."""
    out = {k: {s: [t for r in rs for t in r[k][s]] for s in STEPS} for k in ("times", "cpu")}
    out.update({k: max(r[k] for r in rs) for k in ("peak_mib", "kept_mib", "drift")})
    return out


def table(results: dict[str, dict], clock: str) -> None:
    ref = results.get("peft")
    head = f"{'variant':<9}" + "".join(f"{s + ' s':>12}{'x peft':>8}" for s in STEPS)
    print(head + f"{'peak MiB':>10}{'x peft':>8}{'kept MiB':>10}{'max |W-W0|':>12}")
    for v, r in results.items():
        cells = []
        for s in STEPS:
            m = median(r[clock][s])
            ratio = m / median(ref[clock][s]) if ref else float("nan")
            cells.append(f"{m:>12.3f}{ratio:>8.2f}")
        peak_ratio = r["peak_mib"] / ref["peak_mib"] if ref and ref["peak_mib"] > 0 else float("nan")
        print(
            f"{v:<9}" + "".join(cells) + f"{r['peak_mib']:>10.0f}{peak_ratio:>8.2f}{r['kept_mib']:>10.0f}"
            f"{r['drift']:>12.2e}"
        )


if __name__ == "__main__":
    main()
