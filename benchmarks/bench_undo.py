"""Undo records of merges (apply(undo=...)): merge, strength change and undo time, full copy vs compact
record.

Model: bench_switch's Flux-shaped stack, 500 x Linear(1024, 1024) fp32 (2 GiB), built twice (same seed).
Adapter: bench_switch's rank-16 LoRA on every layer (‖ΔW‖ ≈ 2 % of ‖W‖). One model is merged with
undo="copy" (a full copy of every touched weight: the record loraweave kept before compact records), the other
with undo="auto" (per layer the smaller of compact and copy; here every layer is compact). Timed:

  strength      handle.set_strength("A", s) on each live merge (alternating 0.5 / 1.5), round-robin with the
                order rotated per round (medians)
  apply/remove  the merge and the undo of each model, once (single samples: each is seconds long)

Undo bytes are printed too. Target: a merge-mode strength change with compact records no slower than with
full copies. Memory: two models and one set of copies (~6 GiB).

    .venv/bin/python benchmarks/bench_undo.py [--quick] [--threads 1,default] [--load N]
"""

from __future__ import annotations

import argparse

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from bench_switch import BLOCKS, PER_BLOCK, WIDTH, build, lora
from benchutil import Variant, interleaved, median, table

KINDS = ("copy", "auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 9")
    ap.add_argument(
        "--threads",
        type=benchutil.thread_counts,
        default="1,default",
        help="torch thread counts, each timed in turn (default: 1 and torch's default)",
    )
    benchutil.add_load_arg(ap)
    args = ap.parse_args()
    rounds = 3 if args.quick else 9
    benchutil.setup_torch()
    benchutil.header(
        f"bench_undo: {BLOCKS * PER_BLOCK} layers {WIDTH}x{WIDTH} fp32, rank-16 LoRA, merge mode"
    )
    with benchutil.BackgroundLoad(args.load) as load:
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n-- torch threads {threads}; {load.line()}")
            run(rounds)


def run(rounds: int) -> None:
    """Apply, strength changes and remove per undo kind at the thread count set, one table."""
    import time

    import loraweave
    from loraweave.request.spec import AdapterSpec

    models = {kind: build() for kind in KINDS}
    spec = AdapterSpec(lora(models["copy"], 1), name="A")
    handles, once, cpu = {}, {}, {kind: [] for kind in KINDS}
    for kind in KINDS:
        t0, c0 = time.perf_counter(), time.process_time()
        handles[kind] = loraweave.apply(models[kind], spec, mode="merge", undo=kind)
        once[f"apply {kind}"], once[f"apply {kind} cpu"] = time.perf_counter() - t0, time.process_time() - c0
    state = {kind: 0.5 for kind in KINDS}

    def strength(kind):
        def run():
            state[kind] = 2.0 - state[kind]
            c0 = time.process_time()
            handles[kind].set_strength("A", state[kind])
            cpu[kind].append(
                time.process_time() - c0
            )  # CPU seconds: steadier than wall time on a loaded host

        return run

    variants = [Variant(f"strength {kind}", strength(kind)) for kind in KINDS]
    times = interleaved(variants, rounds=rounds, warmup=1, log=False, collect=False)
    touched = sum(
        m.weight.numel() * m.weight.element_size() for m in models["copy"].modules() if hasattr(m, "weight")
    )
    undo_bytes = {kind: handles[kind].report.undo_bytes() for kind in KINDS}
    for kind in KINDS:
        t0, c0 = time.perf_counter(), time.process_time()
        handles[kind].remove()
        once[f"remove {kind}"], once[f"remove {kind} cpu"] = (
            time.perf_counter() - t0,
            time.process_time() - c0,
        )
    rows = []

    def wall(op, kind):
        return median(times[f"strength {kind}"]) if op == "strength" else once[f"{op} {kind}"]

    def cpu_s(op, kind):
        return median(cpu[kind][1:]) if op == "strength" else once[f"{op} {kind} cpu"]  # [1:]: the warm-up

    for op in ("apply", "strength", "remove"):
        for kind in KINDS:
            rows.append(
                [
                    op,
                    kind,
                    f"{wall(op, kind) * 1e3:.0f}",
                    f"{wall(op, kind) / wall(op, 'copy'):.2f}x",
                    f"{cpu_s(op, kind) * 1e3:.0f}",
                    f"{cpu_s(op, kind) / cpu_s(op, 'copy'):.2f}x",
                ]
            )
    print(benchutil.noise_line())
    print(f"torch threads: {torch.get_num_threads()}")
    print(
        table(["operation", "undo", "wall ms (strength: median)", "vs copy", "cpu ms", "cpu vs copy"], rows)
    )
    for kind in KINDS:
        print(
            f"undo bytes {kind}: {undo_bytes[kind] / 2**20:.1f} MiB = {undo_bytes[kind] / touched:.3f} of "
            f"touched weights"
        )
    ratio = median(times["strength auto"]) / median(times["strength copy"])
    cratio = median(cpu["auto"][1:]) / median(cpu["copy"][1:])
    print(
        f"target: strength change with compact records <= full-copy path: wall {ratio:.2f}x "
        f"{'PASS' if ratio <= 1 else 'FAIL'}, cpu {cratio:.2f}x {'PASS' if cratio <= 1 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
