"""Resident memory a bf16 merge keeps: 40 x Linear(2048, 2048) bf16, a rank-32 LoRA with ‖ΔW‖ = 3 % of ‖W‖ on
every layer (issue 28 part 5's outside check), each undo kind in its own fresh process.

Per case: resident growth after `apply(mode="merge")` (gc + malloc_trim(0) before each VmRSS reading), the
undo record's bytes, peak RSS growth during the merge (/proc/self/clear_refs + VmHWM), merge and remove()
times, and whether remove() restored every weight bit for bit. All relative to the bytes of the weights
touched; medians of `--repeats` runs, the cases interleaved. Target: resident growth of the default merge
(undo="auto") <= 10 %. The children run with glibc's default malloc settings (what a user gets).

    .venv/bin/python benchmarks/bench_merge_memory.py [--layers 40] [--repeats 3]
        [--kinds auto,compact,copy,none]
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
WIDTH, RANK, REL = 2048, 32, 0.03
TARGET = 0.10


def child(kind: str, layers: int) -> dict:
    import ctypes
    import gc
    import time

    import torch
    from torch import nn

    import loraweave

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = nn.ModuleDict({f"l{i}": nn.Linear(WIDTH, WIDTH, bias=False) for i in range(layers)}).bfloat16()
    g = torch.Generator().manual_seed(1)
    sd = {}
    with torch.no_grad():  # under autograd each factor's graph would keep an fp32 copy of W
        for name, m in model.items():
            a, b = torch.randn(RANK, WIDTH, generator=g), torch.randn(WIDTH, RANK, generator=g)
            b *= REL * m.weight.float().norm() / (b @ a).norm()
            sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = a.bfloat16(), b.bfloat16()
    before = {k: v.clone() for k, v in model.state_dict().items()} if kind != "none" else {}
    libc = ctypes.CDLL("libc.so.6")

    def status(field: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    def resident() -> float:
        gc.collect()
        libc.malloc_trim(0)
        return status("VmRSS")

    r0 = resident()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS
    t = time.perf_counter()
    handle = loraweave.apply(model, sd, mode="merge", undo=kind)
    merge_s = time.perf_counter() - t
    peak = status("VmHWM") - r0
    grown = resident() - r0
    record = handle.report.undo_bytes()
    t = time.perf_counter()
    handle.remove()
    remove_s = time.perf_counter() - t
    exact = all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) if before else None
    return {
        "merge_s": merge_s,
        "remove_s": remove_s,
        "peak": peak,
        "resident": grown,
        "record": record,
        "exact": exact,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default="auto,compact,copy,none")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers)))
        return
    kinds = args.kinds.split(",")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env |= {"PYTHONPATH": SRC, "SDNQ_USE_TORCH_COMPILE": "0"}
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for _ in range(args.repeats):  # interleaved: a load change hits every kind alike
        for kind in kinds:
            out = subprocess.run(
                [sys.executable, __file__, "--child", kind, "--layers", str(args.layers)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs[kind].append(json.loads(out.strip().splitlines()[-1]))
    touched = args.layers * WIDTH * WIDTH * 2
    sys.path.insert(0, HERE)
    from benchutil import cpu_model, table

    print(
        f"bench_merge_memory: {args.layers} x Linear({WIDTH}^2) bf16, rank {RANK}, ‖ΔW‖ = {REL:.0%} of ‖W‖, "
        f"touched {touched / 2**20:.0f} MiB, medians of {args.repeats}, cpu={cpu_model()!r}"
    )
    rows = []
    for kind, rs in runs.items():

        def med(field: str, rs=rs) -> float:
            return statistics.median(r[field] for r in rs)

        exact = {r["exact"] for r in rs}
        rows.append(
            [
                kind,
                f"{100 * med('resident') / touched:.2f}%",
                f"{100 * med('record') / touched:.2f}%",
                f"{100 * med('peak') / touched:.1f}%",
                f"{med('merge_s'):.2f}",
                f"{med('remove_s'):.2f}",
                "-" if exact == {None} else str(exact == {True}),
            ]
        )
    print(table(["undo", "resident", "record", "peak", "merge s", "remove s", "bit-exact"], rows))
    if "auto" in runs:
        grown = statistics.median(r["resident"] for r in runs["auto"]) / touched
        print(
            f"target: resident growth of undo='auto' <= {TARGET:.0%}: {grown:.2%} -> "
            f"{'PASS' if grown <= TARGET else 'FAIL'}"
        )


if __name__ == "__main__":
    main()
