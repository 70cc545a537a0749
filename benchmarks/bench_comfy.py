"""loraweave inside ComfyUI against core LoraLoader, on a Flux-shaped model at real width (hidden 3072, 24
heads, context 4096; default 1 double + 1 single block, fp32, ~1.9 GB) on CPU, ComfyUI v0.19.3 in process.

Three cases, each in its own child process (peak RSS per case), each on the same LoRA files (kohya, rank 16,
every Linear of every block; A and B differ in seeds):

  core     comfy.sd.load_lora_for_models (what LoraLoader runs; the state dict cached per file, as LoraLoader
           caches it per node)
  merge    loraweave.comfy.load_lora_for_models(mode="merge")   (ComfyUI patch list, loraweave's ΔW)
  runtime  loraweave.comfy.load_lora_for_models(mode="runtime") (runtime paths under one injection key)

Timed (wall, from the loader call to the moment the first sampling step enters the diffusion model; the step
is then aborted, so only the queue-side cost is timed): the first queue with LoRA A at 1.0 in a fresh process,
every one-off included (file read, imports the queue makes, reference tree; the modules it imports are
counted); a strength change and re-queue (A at 0.5, 0.8, 0.6, 0.9, 0.7); a swap (B, A, B, A, B at 1.0): the
first to B is to a file never read ("new"), the rest to files read before ("kept"). Then one whole 1-step
sample of a model already loaded (the per-step cost of each mode), RSS after malloc_trim(0), peak RSS per
phase, and the bytes of ComfyUI's weight backups (what core keeps to undo a merge) and of loraweave's factor
holder. `--repeats N` runs every case N times, interleaved (core, merge, runtime, core, ...), each in a fresh
process; the table shows medians over all.

Targets (issue 29): runtime strength change and swap < 5% of core's; merge first queue no slower than core; no
backup beyond core's.

Allocator: like every benchmark here, this one runs under benchutil's malloc settings (big blocks from the
heap, never trimmed), which steadies timings. ComfyUI runs under glibc's defaults, where each large temporary
is a fresh mapping whose page faults are timed; `LORAWEAVE_BENCH_NO_REEXEC=1` runs the cases that way. Quote
both.

`--pair N` adds one process where core and merge re-queue alternately on one base model, N rounds of a
strength change and a swap: paired ratios, less at the mercy of a shared host's slow spells than medians of
separate processes (`--repeats 0 --pair N` runs only that).

    .venv/bin/python benchmarks/bench_comfy.py [--double 1] [--single 1] [--rank 16] [--family lora|lokr]
        [--threads 1,default (thread counts timed in turn)] [--load N] [--repeats 1] [--pair 0]
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchutil  # noqa: E402  (re-executes with the malloc settings before torch is imported)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

CASES = ("core", "merge", "runtime")
STRENGTHS = (0.5, 0.8, 0.6, 0.9, 0.7)
SWAPS = ("b", "a", "b", "a", "b")
TOKENS = 16  # text tokens; the 16x16 latent gives 64 image tokens


class FirstStep(Exception):
    """Raised from the diffusion model's pre-hook: the first step started, the queue-side cost is over."""


def stop_at_first_step(module, args):
    raise FirstStep


def flux_params(double: int, single: int) -> dict:
    from helpers.comfy_models import FLUX_PARAMS

    return {
        **FLUX_PARAMS,
        "hidden_size": 3072,
        "num_heads": 24,
        "context_in_dim": 4096,
        "vec_in_dim": 768,
        "depth": double,
        "depth_single_blocks": single,
    }


def flux_shapes(params: dict) -> dict[str, torch.Size]:
    from helpers.comfy_env import import_comfy

    import_comfy()
    import comfy.ldm.flux.model
    import comfy.ops

    with torch.device("meta"):
        model = comfy.ldm.flux.model.Flux(operations=comfy.ops.disable_weight_init, **params)
    return {k: v.shape for k, v in model.state_dict().items()}


def kron_sides(n: int) -> tuple[int, int]:
    """(a, b), a·b = n, a the largest divisor <= sqrt(n): LyCORIS's factorization(n, -1) split."""
    a = max(d for d in range(1, int(n**0.5) + 1) if n % d == 0)
    return a, n // a


def write_loras(folder: Path, shapes: dict, rank: int, family: str = "lora") -> None:
    """Files A and B (seeds 1, 2) on every block Linear: kohya LoRA, or LoKr with a full w1 (the small side of
    LyCORIS's split) and a rank-`rank` w2 = w2_a @ w2_b, as LyCORIS writes it by default."""
    from safetensors.torch import save_file

    targets = [k[: -len(".weight")] for k, s in shapes.items() if k.endswith(".weight") and len(s) == 2]
    targets = [t for t in targets if t.startswith(("double_blocks.", "single_blocks."))]
    for name, seed in (("a", 1), ("b", 2)):
        g = torch.Generator().manual_seed(seed)
        sd = {}
        for t in targets:
            rows, cols = shapes[f"{t}.weight"]
            stem = "lora_unet_" + t.replace(".", "_")
            if family == "lokr":
                (a, b), (c, n) = kron_sides(rows), kron_sides(cols)
                sd[f"{stem}.lokr_w1"] = torch.randn(a, c, generator=g) * 0.1
                sd[f"{stem}.lokr_w2_a"] = torch.randn(b, rank, generator=g) * 0.1
                sd[f"{stem}.lokr_w2_b"] = torch.randn(rank, n, generator=g) * 0.01
            else:
                sd[f"{stem}.lora_down.weight"] = torch.randn(rank, cols, generator=g) * 0.01
                sd[f"{stem}.lora_up.weight"] = torch.randn(rows, rank, generator=g) * 0.01
            sd[f"{stem}.alpha"] = torch.tensor(float(rank))
        save_file(sd, str(folder / f"{name}.safetensors"))


def trimmed_rss_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return benchutil.rss_mib()


def build_model(params: dict):
    import comfy.sd

    shapes = flux_shapes(params)
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    patcher = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"dtype": torch.float32})
    del sd
    return patcher


def loader(case: str):
    """(model, path, strength) -> model clone with the LoRA, as each case's node would call it."""
    import comfy.sd
    import comfy.utils

    if case == "core":
        cache: dict[str, dict] = {}

        def core(model, path, strength):
            if path not in cache:
                cache[path] = comfy.utils.load_torch_file(path, safe_load=True)
            return comfy.sd.load_lora_for_models(model, None, cache[path], strength, 0.0)[0]

        return core
    from loraweave.comfy import load_lora_for_models

    return lambda model, path, strength: load_lora_for_models(model, None, path, strength, 0.0, mode=case)[0]


def sample(model, cond, until_first_step: bool):
    import nodes

    latent = {"samples": torch.zeros(1, 16, 16, 16)}
    args = (model, 0, 1, 1.0, "euler", "simple", cond, cond, latent)
    if not until_first_step:
        return nodes.common_ksampler(*args)
    try:
        nodes.common_ksampler(*args)
    except FirstStep:
        return None
    raise RuntimeError("sampling ended without entering the diffusion model")


def child(case: str, folder: Path, params: dict) -> dict:
    from helpers.comfy_env import import_comfy

    import_comfy()
    base = build_model(params)
    g = torch.Generator().manual_seed(5)
    cond = [
        [
            torch.randn(1, TOKENS, params["context_in_dim"], generator=g),
            {"pooled_output": torch.randn(1, params["vec_in_dim"], generator=g), "guidance": 3.5},
        ]
    ]
    hook = base.model.diffusion_model.register_forward_pre_hook(stop_at_first_step)
    load = loader(case)
    paths = {n: str(folder / f"{n}.safetensors") for n in ("a", "b")}
    out: dict = {"case": case, "rss_model_mib": trimmed_rss_mib()}

    cpu: dict[str, list[float]] = {"first": [], "strength": [], "swap": []}

    def queue(path: str, strength: float, phase: str) -> float:
        """Wall seconds; the process CPU seconds (all threads) go to `cpu[phase]` (on a loaded machine wall
        time also counts the waits for a core)."""
        t0, c0 = time.perf_counter(), time.process_time()
        model = load(base, path, strength)
        sample(model, cond, until_first_step=True)
        cpu[phase].append(time.process_time() - c0)
        return time.perf_counter() - t0

    benchutil.reset_peak_rss()
    before = set(sys.modules)
    out["first_s"] = queue(paths["a"], 1.0, "first")
    out["first_imports"] = sorted(set(sys.modules) - before)
    out["peak_first_mib"] = benchutil.peak_rss_mib()
    benchutil.reset_peak_rss()
    out["strength_s"] = [queue(paths["a"], s, "strength") for s in STRENGTHS]
    out["peak_strength_mib"] = benchutil.peak_rss_mib()
    benchutil.reset_peak_rss()
    out["swap_s"] = [queue(paths[n], 1.0, "swap") for n in SWAPS]
    out["first_cpu"], out["strength_cpu"], out["swap_cpu"] = cpu["first"][0], cpu["strength"], cpu["swap"]
    out["peak_swap_mib"] = benchutil.peak_rss_mib()
    hook.remove()
    model = load(base, paths["b"], 1.0)
    sample(model, cond, until_first_step=False)  # loads (and for core/merge patches) the model
    t0 = time.perf_counter()
    sample(model, cond, until_first_step=False)  # the same model again: one step, nothing re-patched
    out["step_s"] = time.perf_counter() - t0
    out["rss_end_mib"] = trimmed_rss_mib()
    out["backup_mib"] = sum(b.weight.numel() * b.weight.element_size() for b in base.backup.values()) / 2**20
    from loraweave.comfy.runtime import KEY

    holders = model.get_additional_models_with_key(KEY)
    out["factors_mib"] = sum(h.model_size() for h in holders) / 2**20
    out["model_mib"] = base.model_size() / 2**20
    return out


def paired(folder: Path, params: dict, rounds: int) -> dict:
    """core and merge re-queues alternating on one base model in one process (ComfyUI unpatches one clone
    when it loads the other): per round a strength change of A and a swap to B and back, each loader first
    in turn. The host's slow spells then hit both about alike; the ratio is the median of per-round ratios."""
    from helpers.comfy_env import import_comfy

    import_comfy()
    base = build_model(params)
    g = torch.Generator().manual_seed(5)
    cond = [
        [
            torch.randn(1, TOKENS, params["context_in_dim"], generator=g),
            {"pooled_output": torch.randn(1, params["vec_in_dim"], generator=g), "guidance": 3.5},
        ]
    ]
    base.model.diffusion_model.register_forward_pre_hook(stop_at_first_step)
    loads = {case: loader(case) for case in ("core", "merge")}
    paths = {n: str(folder / f"{n}.safetensors") for n in ("a", "b")}
    for load in loads.values():  # first queues: file reads, imports, reference tree
        sample(load(base, paths["a"], 1.0), cond, until_first_step=True)
    cost: dict[str, dict[str, list[float]]] = {c: {"wall": [], "cpu": []} for c in loads}
    for r in range(rounds):
        order = list(loads) if r % 2 == 0 else list(loads)[::-1]
        for name, strength in ((paths["a"], STRENGTHS[r % 5]), (paths["b"], 1.0)):
            for case in order:
                t0, c0 = time.perf_counter(), time.process_time()
                sample(loads[case](base, name, strength), cond, until_first_step=True)
                cost[case]["cpu"].append(time.process_time() - c0)
                cost[case]["wall"].append(time.perf_counter() - t0)
    return {"case": "pair", "cost": cost}


def report_pair(out: dict) -> None:
    cost = out["cost"]
    print("-- core and merge re-queues alternating in one process (strength change and swap per round)")
    for clock in ("wall", "cpu"):
        core, merge = cost["core"][clock], cost["merge"][clock]
        ratios = [m / c for m, c in zip(merge, core, strict=True)]
        print(
            f"{clock}: core {median(core):.3f} s, merge {median(merge):.3f} s (n={len(core)}); merge/core: "
            f"ratio of medians {median(merge) / median(core):.3f}, median of paired ratios "
            f"{median(ratios):.3f} (quartiles {sorted(ratios)[len(ratios) // 4]:.3f}-"
            f"{sorted(ratios)[3 * len(ratios) // 4]:.3f})"
        )


def median(xs) -> float:
    return benchutil.median(list(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--double", type=int, default=1)
    ap.add_argument("--single", type=int, default=1)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument(
        "--threads",
        type=benchutil.thread_counts,
        default="1,default",
        help="torch thread counts, each timed in turn (default: 1 and torch's default)",
    )
    benchutil.add_load_arg(ap)
    ap.add_argument("--family", choices=("lora", "lokr"), default="lora", help="the files' family")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per case (interleaved)")
    ap.add_argument("--pair", type=int, default=0, help="rounds of core/merge re-queues in one process")
    ap.add_argument("--child", choices=(*CASES, "pair"))
    ap.add_argument("--dir")
    args = ap.parse_args()
    if args.child:
        torch.set_num_threads(args.threads[0])
    params = flux_params(args.double, args.single)
    if args.child == "pair":
        print(json.dumps(paired(Path(args.dir), params, args.pair)))
        return
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir), params)))
        return
    with benchutil.BackgroundLoad(args.load) as load:
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n-- torch threads {threads}; {load.line()}")
            compare(args, params)


def compare(args: argparse.Namespace, params) -> None:
    """Every case in fresh processes at torch's current thread count; the tables."""
    benchutil.header(
        f"ComfyUI: loraweave vs core LoraLoader, Flux width 3072, {args.double}+{args.single} blocks, "
        f"{args.family} rank {args.rank}, load {os.getloadavg()}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-comfy-") as tmp:
        write_loras(Path(tmp), flux_shapes(params), args.rank, args.family)
        results: dict[str, list[dict]] = {case: [] for case in CASES}
        for _ in range(args.repeats):
            for case in CASES:
                results[case].append(run_child(case, tmp, args))
        pair = run_child("pair", tmp, args) if args.pair else None
    if args.repeats:
        report(results)
    if pair is not None:
        report_pair(pair)


def run_child(case: str, folder: str, args: argparse.Namespace) -> dict:
    """One case in a fresh process; its raw record is printed first (a report bug loses nothing)."""
    cmd = [sys.executable, __file__, "--child", case, "--dir", folder, "--double", str(args.double)]
    cmd += ["--single", str(args.single), "--rank", str(args.rank), "--pair", str(args.pair)]
    cmd += ["--threads", str(torch.get_num_threads())]
    run = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if run.returncode != 0:
        sys.exit(f"case {case} failed:\n{run.stderr[-4000:]}")
    record = json.loads(run.stdout.strip().splitlines()[-1])
    print(json.dumps(record), flush=True)
    return record


def summary(runs: list[dict], clock: str) -> dict:
    """Medians over a case's fresh processes on `clock` ("s": wall, "cpu": process CPU): the first queue (one
    per process), every strength re-queue and kept swap of all processes pooled, the swap to the new file (one
    per process)."""
    pooled = lambda key: [x for r in runs for x in r[key]]  # noqa: E731
    return {
        "first_s": median(r[f"first_{clock}"] for r in runs),
        "strength_s": median(pooled(f"strength_{clock}")),
        "swap_new_s": median(r[f"swap_{clock}"][0] for r in runs),
        "swap_kept_s": median(x for r in runs for x in r[f"swap_{clock}"][1:]),
        "step_s": median(r["step_s"] for r in runs),
        "peaks": "/".join(
            f"{max(r[k] for r in runs):.0f}" for k in ("peak_first_mib", "peak_strength_mib", "peak_swap_mib")
        ),
        "rss_end_mib": median(r["rss_end_mib"] for r in runs),
        "backup_mib": max(r["backup_mib"] for r in runs),
        "factors_mib": max(r["factors_mib"] for r in runs),
        "imports": median(len(r["first_imports"]) for r in runs),
        "n": len(runs),
    }


def report(results: dict[str, list[dict]]) -> None:
    first = results["core"][0]
    print(f"model {first['model_mib']:.0f} MiB fp32; RSS after building it: {first['rss_model_mib']:.0f} MiB")
    for clock, label in (("s", "wall seconds"), ("cpu", "process CPU seconds (all threads)")):
        print(f"-- {label}")
        report_clock({case: summary(runs, clock) for case, runs in results.items()})


def report_clock(stats: dict[str, dict]) -> None:
    core = stats["core"]
    rows = [
        [
            case,
            f"{r['first_s']:.3f}",
            f"{r['strength_s']:.3f}",
            f"{r['swap_kept_s']:.3f}",
            f"{r['swap_new_s']:.3f}",
            f"{r['step_s']:.2f}",
            r["peaks"],
            f"{r['rss_end_mib']:.0f}",
            f"{r['backup_mib']:.0f}",
            f"{r['factors_mib']:.1f}",
            f"{r['imports']:.0f}",
        ]
        for case, r in stats.items()
    ]
    headers = ["case", "first s", "strength s", "swap kept s", "swap new s", "1-step s", "peak MiB f/s/w"]
    headers += ["RSS end", "backup MiB", "factors MiB", "first-queue imports"]
    print(benchutil.table(headers, rows))
    for case in ("merge", "runtime"):
        r = stats[case]
        ratios = {k: r[k] / core[k] for k in ("first_s", "strength_s", "swap_kept_s", "swap_new_s")}
        print(
            f"{case}/core: first {ratios['first_s']:.3f}  strength {ratios['strength_s']:.4f}  "
            f"swap kept {ratios['swap_kept_s']:.4f}  swap new {ratios['swap_new_s']:.4f}  "
            f"backup {r['backup_mib']:.0f}/{core['backup_mib']:.0f} MiB"
        )
    merge, runtime = stats["merge"], stats["runtime"]
    targets = {
        "runtime strength < 5% of core": runtime["strength_s"] < 0.05 * core["strength_s"],
        "runtime swap (kept file) < 5% of core": runtime["swap_kept_s"] < 0.05 * core["swap_kept_s"],
        "runtime swap (new file) < 5% of core": runtime["swap_new_s"] < 0.05 * core["swap_new_s"],
        "merge first queue <= core (one-offs included)": merge["first_s"] <= core["first_s"],
        "no backup beyond core's": max(merge["backup_mib"], runtime["backup_mib"]) <= core["backup_mib"],
    }
    for name, met in targets.items():
        print(f"target {name}: {'met' if met else 'NOT met'}")
    print(
        f"medians over {core['n']} fresh process(es) per case; strength/swap kept: 5 and 4 re-queues per "
        f"process "
        "(loader call to the first step entering the model)"
    )


if __name__ == "__main__":
    main()
