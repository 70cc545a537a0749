"""torch.compile and rank padding: the runtime path's overhead eager vs compiled (inductor, CPU), and what
padding a rank-16 LoRA to bucket 32 costs.

One Linear(3072, 3072) fp32, x of 4096 tokens, rank-16 LoRA. Variants, timed sandwiched between runs of their
own reference (eager variants against the eager base, compiled ones against the compiled base), medians of
per-sample ratios:

  eager r16         apply(mode="runtime")
  eager r16->32     apply(mode="runtime", compile_friendly=True, rank_buckets=(32,))
  compiled r16      the same as eager r16 with compile_friendly=True, rank_buckets=(16,), under torch.compile
  compiled r16->32  bucket 32, under torch.compile

Default clock: CPU seconds of this process with one torch thread, as bench_floor.py (`--threads 2 --clock
wall` for the old style, which the shared 2-core host cannot resolve at these percentages).

    .venv/bin/python benchmarks/bench_compile.py [--quick] [--rounds N] [--threads 1] [--clock cpu|wall]
"""

from __future__ import annotations

import copy
import time

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, inference_forward, linear_lora, median, sandwiched, table

IN = OUT = 3072
TOKENS = 4096
RANK = 16


def main() -> None:
    args = benchutil.parse_args(__doc__, quick=5, full=9, extra=benchutil.add_clock_args)
    benchutil.setup_torch()
    clock = benchutil.use_clock_args(args)
    benchutil.header(
        "bench_compile: Linear(3072, 3072) fp32, x (1, 4096, 3072), rank-16 LoRA, eager vs inductor; "
        f"clock={args.clock}"
    )
    import loraweave

    base, sd, x = linear_lora(IN, OUT, TOKENS, RANK, alpha=8.0)
    keep, models = [], {}
    for name, kw in {
        "r16": {},
        "r16->32": {"compile_friendly": True, "rank_buckets": (32,)},
        "cf r16": {"compile_friendly": True, "rank_buckets": (16,)},
    }.items():
        m = copy.deepcopy(base)
        keep.append(loraweave.apply(m, sd, mode="runtime", strict=True, **kw))
        models[name] = m
    compiled, compile_s = {}, {}
    for name, m in {"base": base, "r16": models["cf r16"], "r16->32": models["r16->32"]}.items():
        c = torch.compile(copy.deepcopy(m) if name == "base" else m, backend="inductor")
        t0 = time.perf_counter()
        with torch.inference_mode():
            c(x)
        compile_s[name], compiled[name] = time.perf_counter() - t0, c
    with torch.inference_mode():
        want = models["r16"](x)
        agree = {
            n: float((c(x) - (base(x) if n == "base" else want)).abs().max()) for n, c in compiled.items()
        }
        agree["eager r16->32"] = float((models["r16->32"](x) - want).abs().max())
    rows = []
    for label, ref, others in (
        (
            "eager",
            Variant("base", inference_forward(base, x)),
            [
                Variant("r16", inference_forward(models["r16"], x)),
                Variant("r16->32", inference_forward(models["r16->32"], x)),
            ],
        ),
        (
            "compiled",
            Variant("base", inference_forward(compiled["base"], x)),
            [
                Variant("r16", inference_forward(compiled["r16"], x)),
                Variant("r16->32", inference_forward(compiled["r16->32"], x)),
            ],
        ),
    ):
        res = sandwiched(ref, others, rounds=args.rounds, warmup=1, clock=clock)
        for v in others:
            lo, hi = res.interval(v.name)
            rows.append(
                [
                    f"{label} {v.name}",
                    f"{median(res.times['base']) * 1e3:.1f}",
                    f"{median(res.times[v.name]) * 1e3:.1f}",
                    res.quiet_count(v.name),
                    f"{(res.ratio(v.name) - 1) * 100:+.2f}%",
                    f"{(lo - 1) * 100:+.2f}% .. {(hi - 1) * 100:+.2f}%",
                ]
            )
    floor = RANK * (IN + OUT) / (IN * OUT)
    print(f"rounds={args.rounds}; {benchutil.noise_line()}")
    print(
        table(["variant", "its base ms", "median ms", "quiet", "overhead vs its base", "90% interval"], rows)
    )
    print(
        f"FLOP share of the LoRA pair: r16 {floor * 100:.2f}%, padded to 32 {2 * floor * 100:.2f}% of the "
        f"base GEMM"
    )
    print("first compiled call (compile) s: " + ", ".join(f"{k} {v:.1f}" for k, v in compile_s.items()))
    print("max abs diff vs eager: " + ", ".join(f"{k} {v:.2e}" for k, v in agree.items()))
    del keep


if __name__ == "__main__":
    main()
