"""Undo records of merges (apply(undo=...)): merge, strength change and undo time, full copy vs compact record.

Model: bench_switch's Flux-shaped stack, 500 x Linear(1024, 1024) fp32 (2 GiB). Adapter: a rank-16 LoRA on every
layer (‖ΔW‖ ≈ 2 % of ‖W‖). One model; each sample applies with the variant's record kind (untimed), times one
operation, and removes (untimed), round-robin with the order rotated per round (medians):

  apply         loraweave.apply(model, A, mode="merge", undo=KIND)
  strength      handle.set_strength("A", s) on a live merge (alternating 0.5 / 1.5)
  remove        handle.remove() (the undo itself)

KIND = "copy" (a full copy of every touched weight: the record loraweave kept before compact records) and
"auto" (per layer the smaller of compact and copy; here every layer is compact). Undo bytes are printed too.
Target: a merge-mode strength change with compact records no slower than with full copies.

    .venv/bin/python benchmarks/bench_undo.py [--quick]
"""

from __future__ import annotations

import argparse

import benchutil  # first: re-execs with the malloc settings before torch is loaded
from bench_switch import BLOCKS, PER_BLOCK, WIDTH, build, lora
from benchutil import Variant, interleaved, median, table

KINDS = ("copy", "auto")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 7")
    rounds = 3 if ap.parse_args().quick else 7
    benchutil.setup_torch()
    benchutil.header(f"bench_undo: {BLOCKS * PER_BLOCK} layers {WIDTH}x{WIDTH} fp32, rank-16 LoRA, merge mode")
    import loraweave
    from loraweave.spec import AdapterSpec

    model = build()
    sd = lora(model, 1)
    spec = AdapterSpec(sd, name="A")
    state: dict = {"handle": None, "s": 0.5}
    undo_bytes: dict[str, int] = {}

    def apply_with(kind):
        def run():
            state["handle"] = loraweave.apply(model, spec, mode="merge", undo=kind)
            undo_bytes[kind] = state["handle"].report.undo_bytes()
        return run

    def remove():
        if state["handle"] is not None:
            state["handle"].remove()
            state["handle"] = None

    def strength():
        state["s"] = 2.0 - state["s"]
        state["handle"].set_strength("A", state["s"])

    variants = []
    for kind in KINDS:
        variants += [Variant(f"apply {kind}", apply_with(kind), cleanup=remove),
                     Variant(f"strength {kind}", strength, prepare=apply_with(kind), cleanup=remove),
                     Variant(f"remove {kind}", remove, prepare=apply_with(kind))]
    times = interleaved(variants, rounds=rounds, warmup=1, log=False, collect=False)
    touched = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if hasattr(m, "weight"))
    rows = []
    for op in ("apply", "strength", "remove"):
        ref = median(times[f"{op} copy"])
        for kind in KINDS:
            med = median(times[f"{op} {kind}"])
            rows.append([op, kind, f"{med * 1e3:.1f}", f"{med / ref:.2f}x"])
    print(benchutil.noise_line())
    print(table(["operation", "undo", "median ms", "vs copy"], rows))
    for kind in KINDS:
        print(f"undo bytes {kind}: {undo_bytes[kind] / 2**20:.1f} MiB = {undo_bytes[kind] / touched:.3f} of touched weights")
    ratio = median(times["strength auto"]) / median(times["strength copy"])
    print(f"target: strength change with compact records <= full-copy path: {ratio:.2f}x {'PASS' if ratio <= 1 else 'FAIL'}")


if __name__ == "__main__":
    main()
