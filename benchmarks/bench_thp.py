"""numpy's transparent-huge-page advice on loraweave's merge / undo / switch paths: NUMPY_MADVISE_HUGEPAGE=0
vs default.

numpy (>= 1.x on Linux) calls madvise(MADV_HUGEPAGE) on every array buffer of 4 MiB or more unless the
environment variable NUMPY_MADVISE_HUGEPAGE=0 is set at import; torch does not. On a host with THP
`enabled=madvise` and `defrag=madvise`, the first touch of such memory faults in 2 MiB pages (zeroed, and
compacted for when memory is fragmented): kernel (sys) time in the faulting thread. This script measures
whether that costs loraweave anything.

Each round starts fresh child processes, alternately with NUMPY_MADVISE_HUGEPAGE=0 ("plain") and without it
("thp", numpy's default), the order rotated per round. Each child (--child) builds N x Linear(1024, 1024) fp32
(one torch thread), merges a rank-16 LoRA "A" with the default undo record (compact here), then per step: a
strength change, switch A->B, switch B->A; then remove(). Per operation it records wall seconds, user and sys
CPU seconds (getrusage of the child itself) and the child's AnonHugePages after it (/proc/self/smaps_rollup:
huge pages this process holds). The parent adds the child's whole rusage (os.wait4) and the delta of
/proc/vmstat thp_fault_alloc over the child's life (system-wide: another process's faults count too). Two
malloc settings, both interleaved: "bench" (benchutil's MALLOC_* settings: big blocks from a kept heap) and
"glibc" (defaults: what a user's process gets). Printed: medians over children of per-op medians, and
thp/plain ratios of wall time and of CPU time (user + sys: on a shared host the steadier clock).

--scale sets the std of the LoRA factors' entries: 0.01 (default) is a usual LoRA (small ΔW: few rounding
misses, the native kernel's "gaps8" record, no numpy buffer at all); 0.1 makes ΔW larger than W (60 % misses:
"bitmask" records, whose numpy scans allocate 9-45 MB per layer). --srcs compares source trees in the same
run, e.g. main against a candidate extracted with `git archive <rev> src | tar -x -C /tmp/cand`:
`--srcs main=src,cand=/tmp/cand/src`; the last column divides each tree's default-THP CPU time (user + sys) by
the first's.

    .venv/bin/python benchmarks/bench_thp.py [--rounds N] [--layers N] [--width N] [--steps N] [--scale S]
        [--malloc bench,glibc] [--srcs label=path,...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# no re-exec: this parent sets each child's malloc settings itself
os.environ["LORAWEAVE_BENCH_NO_REEXEC"] = "1"
from benchutil import MALLOC_ENV, cpu_model  # noqa: E402

OPS = ("apply", "strength", "switch A->B", "switch B->A", "remove")
WIDTH, RANK = 1024, 16


def thp_faults() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("thp_fault_alloc "):
                return int(line.split()[1])
    return -1


def anon_huge_mib() -> float:
    """This process's anonymous memory held in transparent huge pages (/proc/self/smaps_rollup), MiB."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    return -1.0


def child(layers: int, steps: int, width: int, dtype: str, scale: float) -> None:
    import torch

    import loraweave
    from loraweave import AdapterSpec

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(
        getattr(torch, dtype)
    )

    def lora(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        sd = {}
        for i in range(layers):
            sd[f"{i}.lora_A.weight"] = torch.randn(RANK, width, generator=g) * scale
            sd[f"{i}.lora_B.weight"] = torch.randn(width, RANK, generator=g) * scale
        return sd

    sets = {"A": lora(1), "B": lora(2)}
    rec: dict[str, list[list[float]]] = {op: [] for op in OPS}
    state: dict[str, object] = {}

    def timed(op: str, fn) -> None:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        fn()
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        rec[op].append([t1 - t0, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime, anon_huge_mib()])

    def apply() -> None:
        state["h"] = loraweave.apply(model, AdapterSpec(sets["A"], name="A"), mode="merge")

    with torch.no_grad():
        timed("apply", apply)
        h = state["h"]
        s = 0.5
        for _ in range(steps):
            s = 1.5 - s
            timed("strength", lambda s=s: h.set_strength("A", s))
            timed("switch A->B", lambda: h.switch(AdapterSpec(sets["B"], name="B")))
            timed("switch B->A", lambda: h.switch(AdapterSpec(sets["A"], name="A")))
        timed("remove", h.remove)
    print(json.dumps(rec))


def first_touch_child() -> None:
    """Seconds to allocate and fill fresh numpy and torch buffers (12 MB, 80 MB), in this fresh process."""
    import numpy as np
    import torch

    rec = {}
    for mb in (12, 80):
        t0 = time.perf_counter()
        np.empty(mb << 20, dtype=np.uint8).fill(1)
        t1 = time.perf_counter()
        torch.empty(mb << 20, dtype=torch.uint8).fill_(1)
        rec[f"numpy {mb} MB"], rec[f"torch {mb} MB"] = t1 - t0, time.perf_counter() - t1
    print(json.dumps(rec))


def first_touch(rounds: int) -> None:
    """The first touch of fresh buffers, numpy vs torch, THP off and numpy's default, fresh processes."""
    times: dict[tuple[str, bool], list[float]] = {}
    for r in range(rounds):
        for thp in (False, True) if r % 2 == 0 else (True, False):
            env = {
                k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "NUMPY_MADVISE_HUGEPAGE"
            }
            if not thp:
                env["NUMPY_MADVISE_HUGEPAGE"] = "0"
            out = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--first-touch-child"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            for k, v in json.loads(out.strip().splitlines()[-1]).items():
                times.setdefault((k, thp), []).append(v)
    print(f"first touch of a fresh buffer (allocate + fill), glibc malloc, median of {rounds} processes, ms:")
    for k in dict.fromkeys(k for k, _ in times):
        plain, thp = med(times[(k, False)]) * 1e3, med(times[(k, True)]) * 1e3
        print(f"  {k:13} plain {plain:7.1f}  thp {thp:7.1f}  thp/plain {thp / plain:5.2f}")


def run_child(script: str, src: str, thp: bool, malloc: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV and k != "NUMPY_MADVISE_HUGEPAGE"}
    if not thp:
        env["NUMPY_MADVISE_HUGEPAGE"] = "0"
    if malloc == "bench":
        env.update(MALLOC_ENV)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.path.abspath(src)
    f0, t0 = thp_faults(), time.perf_counter()
    p = subprocess.Popen(
        [
            sys.executable,
            script,
            "--child",
            "--layers",
            str(args.layers),
            "--steps",
            str(args.steps),
            "--width",
            str(args.width),
            "--dtype",
            args.dtype,
            "--scale",
            str(args.scale),
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    out = p.stdout.read() if p.stdout else ""
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise SystemExit(f"child failed: status={status}")
    rec = json.loads(out.strip().splitlines()[-1])
    rec["_child"] = [[time.perf_counter() - t0, ru.ru_utime, ru.ru_stime, thp_faults() - f0]]
    return rec


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--malloc", default="bench,glibc")
    ap.add_argument("--width", type=int, default=WIDTH)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--scale", type=float, default=0.01, help="std of the LoRA factors' entries")
    ap.add_argument("--srcs", default="lib=src", help="label=path of loraweave's src, comma-separated")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--first-touch-child", action="store_true")
    args = ap.parse_args()
    if args.first_touch_child:
        first_touch_child()
        return
    if args.child:
        child(args.layers, args.steps, args.width, args.dtype, args.scale)
        return
    script = os.path.abspath(__file__)
    thp_mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    defrag = open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip()
    print(
        f"== bench_thp: {args.layers} x Linear({args.width}, {args.width}) {args.dtype}, rank {RANK}, factor "
        f"std {args.scale}, {args.steps} steps/child"
    )
    print(
        f"cpu={cpu_model()!r} cpus={os.cpu_count()} load={os.getloadavg()} thp={thp_mode!r} defrag={defrag!r}"
    )
    first_touch(args.rounds)
    mallocs = args.malloc.split(",")
    srcs = dict(item.split("=", 1) for item in args.srcs.split(","))
    print(f"sources: {srcs}")
    configs = [(m, code, thp) for m in mallocs for code in srcs for thp in (False, True)]
    runs: dict[tuple[str, str, bool], list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for m, code, thp in order:
            runs[(m, code, thp)].append(run_child(script, srcs[code], thp, m, args))
        print(f"round {r + 1}/{args.rounds} done, load={os.getloadavg()[0]:.2f}", flush=True)
    print()
    print(
        "per op: median over children of each child's median, ms; huge: the child's AnonHugePages after the "
        "op (MiB); whole child: seconds, huge = thp_fault_alloc delta over the child's life (system-wide)"
    )
    first = next(iter(srcs))
    head = f"{'malloc':6} {'src':5} {'op':15} | {'plain wall':>10} {'user':>7} {'sys':>7} {'huge':>4} |"
    head += f" {'thp wall':>9} {'user':>7} {'sys':>7} {'huge':>4} | {'thp/plain wall':>14} {'cpu':>5} |"
    head += f" {'thp cpu/' + first:>13}"
    print(head)
    for m in mallocs:
        for code in srcs:
            for op in (*OPS, "_child"):
                cells = {}
                for c in {(m, code, False), (m, code, True), (m, first, True)}:
                    per = [[med([s[k] for s in rec[op]]) for k in range(4)] for rec in runs[c]]
                    cells[c] = [med([p[k] for p in per]) for k in range(4)]
                pw, pu, ps, pf = cells[(m, code, False)]
                tw, tu, ts, tf = cells[(m, code, True)]
                scale = 1.0 if op == "_child" else 1e3
                name = "whole child (s)" if op == "_child" else op
                print(
                    f"{m:6} {code:5} {name:15} | {pw * scale:10.1f} {pu * scale:7.1f} {ps * scale:7.1f} "
                    f"{pf:4.0f} | {tw * scale:9.1f} {tu * scale:7.1f} {ts * scale:7.1f} {tf:4.0f} | "
                    f"{tw / pw:14.2f} {(tu + ts) / (pu + ps):5.2f} | "
                    f"{(tu + ts) / sum(cells[(m, first, True)][1:3]):13.2f}"
                )
    print(f"load at end={os.getloadavg()}")


if __name__ == "__main__":
    main()
