"""Merge memory of undo records at a mid size: N x Linear(2048, 2048) fp16 on CPU, a rank-32 LoRA on every
layer (‖ΔW‖ = 2 % of ‖W‖, a trained LoRA's usual order), each undo kind in its own fresh process.

Per kind: merge time, peak RSS growth during the merge (/proc/self/clear_refs + VmHWM), resident growth after
the merge (gc + malloc_trim(0)), undo time; ratios against undo="copy" (a full copy of every touched weight,
the record loraweave kept before compact records) measured in the same run. Each kind runs `--repeats` times
(medians). Issue-15 targets: resident growth <= 10 % of touched bytes, peak growth <= largest layer + 10 % of
touched bytes, merge time <= 1.3x the full-copy path. Memory is measured in children with a fixed
MALLOC_MMAP_THRESHOLD_ (freed temporaries leave the resident set at once), times in children with glibc's
defaults. (The full-size SDXL version is bench_undo_sdxl.py.)

    .venv/bin/python benchmarks/bench_undo_memory.py [--layers 40] [--repeats 3] [--kinds copy,auto,compact]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
WIDTH, RANK, REL = 2048, 32, 0.02


def child(kind: str, layers: int) -> None:
    import ctypes
    import gc
    import time

    import torch
    from torch import nn

    import loraweave

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.ModuleDict({f"l{i}": nn.Linear(WIDTH, WIDTH, bias=False) for i in range(layers)}).half()
    g = torch.Generator().manual_seed(1)
    sd = {}
    for name, m in model.items():
        a, b = torch.randn(RANK, WIDTH, generator=g), torch.randn(WIDTH, RANK, generator=g)
        with torch.no_grad():  # under autograd each factor's graph would keep an fp32 copy of W
            b *= REL * m.weight.float().norm() / (b @ a).norm()
        sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = a.half(), b.half()
    libc = ctypes.CDLL("libc.so.6")

    def status(field: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field + ":"))

    def resident() -> float:
        gc.collect()
        libc.malloc_trim(0)
        return status("VmRSS")

    r0 = resident()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    t = time.perf_counter()
    handle = loraweave.apply(model, sd, mode="merge", undo=kind)
    merge_s = time.perf_counter() - t
    peak = status("VmHWM") - r0
    grown = resident() - r0
    record = handle.report.undo_bytes() / 2**20
    t = time.perf_counter()
    handle.remove()
    undo_s = time.perf_counter() - t
    print(
        json.dumps(
            {
                "merge_s": merge_s,
                "undo_s": undo_s,
                "peak_mib": peak,
                "resident_mib": grown,
                "record_mib": record,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="copy,auto,compact")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.layers)
    kinds = args.kinds.split(",")
    base_env = {**os.environ, "PYTHONPATH": SRC, "SDNQ_USE_TORCH_COMPILE": "0"}
    # Memory pass: a fixed mmap threshold returns freed large blocks to the OS at once, so VmHWM is the live
    # peak (glibc's dynamic threshold otherwise rises to 32 MiB and keeps freed temporaries resident). Timing
    # pass: glibc's defaults, since the fixed threshold page-faults every temporary and would bias the times.
    passes = {"memory": {**base_env, "MALLOC_MMAP_THRESHOLD_": "131072"}, "timing": base_env}
    runs: dict[str, dict[str, list[dict]]] = {p: {k: [] for k in kinds} for p in passes}
    for _ in range(args.repeats):  # interleaved, so load changes hit every kind alike
        for name, env in passes.items():
            for kind in kinds:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", kind, "--layers", str(args.layers)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                runs[name][kind].append(json.loads(out.strip().splitlines()[-1]))
    touched = args.layers * WIDTH * WIDTH * 2 / 2**20
    largest = WIDTH * WIDTH * 2 / 2**20
    med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs["memory"].items()}
    for k, v in runs["timing"].items():  # times from the timing pass
        med[k].update({f: statistics.median(r[f] for r in v) for f in ("merge_s", "undo_s")})
    base = med.get("copy")
    print(
        f"bench_undo_memory: {args.layers} x Linear({WIDTH}^2) fp16, rank {RANK}, touched {touched:.0f} MiB, "
        f"largest layer {largest:.0f} MiB, medians of {args.repeats}"
    )
    print(
        f"{'kind':8s} {'merge s':>8s} {'x copy':>7s} {'undo s':>7s} {'peak MiB':>9s} {'% touched':>9s} "
        f"{'resident MiB':>12s} {'% touched':>9s} {'record MiB':>10s}"
    )
    for k, m in med.items():
        ratio = f"{m['merge_s'] / base['merge_s']:.2f}" if base else "-"
        print(
            f"{k:8s} {m['merge_s']:8.2f} {ratio:>7s} {m['undo_s']:7.2f} {m['peak_mib']:9.0f} "
            f"{100 * m['peak_mib'] / touched:8.1f}% {m['resident_mib']:12.0f} "
            f"{100 * m['resident_mib'] / touched:8.1f}% {m['record_mib']:10.1f}"
        )
    print(
        f"targets: resident <= {0.1 * touched:.0f} MiB, peak <= {largest + 0.1 * touched:.0f} MiB, merge <= "
        f"1.3x copy"
    )


if __name__ == "__main__":
    main()
