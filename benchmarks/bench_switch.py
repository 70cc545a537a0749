"""Switching adapter sets on a live model vs re-applying from scratch, merge and runtime mode.

Model: a Flux-shaped stack of 50 blocks x 10 Linear layers (500 layers; width 1024, fp32, so the run fits
beside other work on a 24 GB machine; Flux itself is 3072 wide with 14/6 linears per double/single block).
Adapters: A and B, rank-16 LoRAs on every layer (different seeds), held in memory.

Timed per round (round-robin, medians):
  strength change     handle.set_strength("A", s) (alternating values)
  switch A->B, B->A   handle.switch(B) / handle.switch(A)
  drop B (of A+B)     handle.switch(A) on a handle holding A+B (runtime: gates, no allocation)
  re-apply            handle.remove() + loraweave.apply(model, B): what a loader without switching does
Target: runtime-mode strength change < 5 ms for 500 layers.

    .venv/bin/python benchmarks/bench_switch.py [--quick] [--threads 1,default] [--load N]
"""

from __future__ import annotations

import argparse

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, interleaved, median, table

BLOCKS, PER_BLOCK, WIDTH, RANK = 50, 10, 1024, 16


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(PER_BLOCK)])
            for _ in range(BLOCKS)
        ]
    )


def lora(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            sd[f"{name}.lora_A.weight"] = torch.randn(RANK, WIDTH, generator=g) * 0.01
            sd[f"{name}.lora_B.weight"] = torch.randn(WIDTH, RANK, generator=g) * 0.01
    return sd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 10")
    ap.add_argument(
        "--threads",
        type=benchutil.thread_counts,
        default="1,default",
        help="torch thread counts, each timed in turn (default: 1 and torch's default)",
    )
    benchutil.add_load_arg(ap)
    args = ap.parse_args()
    rounds = 3 if args.quick else 10
    benchutil.setup_torch()
    benchutil.header(f"bench_switch: {BLOCKS * PER_BLOCK} layers {WIDTH}x{WIDTH}, rank {RANK}")
    with benchutil.BackgroundLoad(args.load) as load:
        for threads in args.threads:
            torch.set_num_threads(threads)
            print(f"\n-- torch threads {threads} (wall ms); {load.line()}")
            run(rounds)


def run(rounds: int) -> None:
    """Every operation in runtime and merge mode at the thread count set, one table."""
    import loraweave
    from loraweave.request.spec import AdapterSpec

    model = build()
    sets = {"A": lora(model, 1), "B": lora(model, 2)}
    rows = []
    results = {}
    for mode in ("runtime", "merge"):
        state = {"handle": loraweave.apply(model, AdapterSpec(sets["A"], name="A"), mode=mode), "s": 0.5}

        def set_strength(st=state):
            st["s"] = 1.5 - st["s"]
            st["handle"].set_strength("A", st["s"])

        def to_set(names, st=state):
            def run():
                st["handle"].switch([AdapterSpec(sets[n], name=n) for n in names])

            return run

        def reapply(st=state, mode=mode):
            st["handle"].remove()
            st["handle"] = loraweave.apply(model, AdapterSpec(sets["B"], name="B"), mode=mode)

        def back_to_a(st=state):
            st["handle"].switch(AdapterSpec(sets["A"], name="A"))

        variants = [
            Variant("strength change", set_strength),
            Variant("switch A->B", to_set(["B"]), cleanup=back_to_a),
            Variant("switch B->A", to_set(["A"]), prepare=to_set(["B"])),
            Variant("drop B (of A+B)", to_set(["A"]), prepare=to_set(["A", "B"])),
            Variant("re-apply B from scratch", reapply, cleanup=back_to_a),
        ]
        times = interleaved(variants, rounds=rounds, warmup=1, log=False, collect=False)
        ref = median(times["re-apply B from scratch"])
        for v in variants:
            med = median(times[v.name])
            rows.append([mode, v.name, f"{med * 1e3:.2f}", f"{ref / med:.1f}x"])
        results[mode] = times
        state["handle"].remove()
    print(benchutil.noise_line())
    print(table(["mode", "operation", "median ms", "faster than re-apply"], rows))
    ms = median(results["runtime"]["strength change"]) * 1e3
    print()
    print(
        f"target: runtime strength change for {BLOCKS * PER_BLOCK} layers {ms:.2f} ms < 5 ms: "
        f"{'PASS' if ms < 5 else 'FAIL'}"
    )


if __name__ == "__main__":
    main()
