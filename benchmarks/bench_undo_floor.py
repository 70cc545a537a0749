"""How fast can a merge-mode strength change with an exact compact undo record be? Raw-op lower bounds vs a
copy.

bench_undo.py measures loraweave's strength change: compact records vs full copies. This script asks whether
any implementation of the compact record could match the copy, by timing the bare tensor operations each one
must run per layer (no planning, no records, no Python beyond the ops), on bench_switch's layers (1024x1024
fp32, rank-16 LoRA, 60 layers, one torch thread):

  copy          what the copy record does: W back from its copy; ΔW (zero + addmm) and W'' = W + ΔW per block
                of 256 rows into a scratch; the non-finite check (aminmax); W'' copied into the weight
  compact       the least a compact record needs, per block, in place: ΔW_old; W = W' - ΔW_old; ΔW_new;
                W'' = W + ΔW_new written into the weight; aminmax; guess = W'' - ΔW_new; the positions where
                the guess misses W (numpy compare + flatnonzero, as mechanisms/merge/bitscan.py); W's bits
                there
  compact, P    the same with ΔW = c·(B·A) formed once per block and folded into each add (alpha=c): one GEMM
                instead of two, no zeroing, no aminmax (a new non-finite value is always a miss: checked
                there). It would change the bits every merge writes (one rounding of c·(B·A) fewer), so it is
                a bound, not a proposal
The corrections a real record puts back (a few % of elements) are left out: each bound is optimistic.

    .venv/bin/python benchmarks/bench_undo_floor.py [--rounds 7] [--layers 60]
"""

from __future__ import annotations

import argparse
import time

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch

from loraweave.mechanisms.merge.bitscan import differ

WIDTH, RANK, ROWS = 1024, 16, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers", type=int, default=60)
    args = ap.parse_args()
    benchutil.THREADS = 1
    benchutil.setup_torch()
    benchutil.header(
        f"bench_undo_floor: {args.layers} layers {WIDTH}x{WIDTH} fp32, rank {RANK}, blocks of {ROWS} rows"
    )
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(WIDTH, WIDTH, generator=g) * 0.03 for _ in range(args.layers)]
    backups = [w.clone() for w in ws]
    downs = [torch.randn(RANK, WIDTH, generator=g) * 0.01 for _ in range(args.layers)]
    ups = [torch.randn(WIDTH, RANK, generator=g) * 0.01 for _ in range(args.layers)]
    n = ROWS * WIDTH
    delta, merged = torch.empty(WIDTH, WIDTH), torch.empty(WIDTH, WIDTH)
    base, guess, mask = torch.empty(ROWS, WIDTH), torch.empty(ROWS, WIDTH), torch.empty(n, dtype=torch.bool)
    found = []

    def misses(w_new, r0, c):
        torch.add(w_new, delta[:ROWS], alpha=-c, out=guess) if c else torch.sub(
            w_new, delta[:ROWS], out=guess
        )
        pos = differ(guess.view(-1).view(torch.int32), base.view(-1).view(torch.int32), mask)
        found.append(base.view(-1).view(torch.int32)[pos])
        return pos

    def copy_path(i, c_old, c_new):
        w = ws[i]
        w.copy_(backups[i])
        for r0 in range(0, WIDTH, ROWS):
            d = delta[r0 : r0 + ROWS].zero_().addmm_(ups[i][r0 : r0 + ROWS], downs[i], alpha=c_new)
            torch.add(w[r0 : r0 + ROWS], d, out=merged[r0 : r0 + ROWS])
        torch.aminmax(merged)
        w.copy_(merged)

    def compact(i, c_old, c_new):
        w, d = ws[i], delta[:ROWS]
        for r0 in range(0, WIDTH, ROWS):
            rows = w[r0 : r0 + ROWS]
            d.zero_().addmm_(ups[i][r0 : r0 + ROWS], downs[i], alpha=c_old)
            torch.sub(rows, d, out=base)
            d.zero_().addmm_(ups[i][r0 : r0 + ROWS], downs[i], alpha=c_new)
            torch.add(base, d, out=rows)
            torch.aminmax(rows)
            misses(rows, r0, 0.0)

    def compact_p(i, c_old, c_new):
        w, d = ws[i], delta[:ROWS]
        for r0 in range(0, WIDTH, ROWS):
            rows = w[r0 : r0 + ROWS]
            torch.mm(ups[i][r0 : r0 + ROWS], downs[i], out=d)
            torch.add(rows, d, alpha=-c_old, out=base)
            torch.add(base, d, alpha=c_new, out=rows)
            pos = misses(rows, r0, c_new)
            bool(rows.view(-1)[pos].isfinite().all())

    forms = {"copy": copy_path, "compact": compact, "compact, P": compact_p}
    times = {name: [] for name in forms}
    strengths = [0.5, 1.5]
    for r in range(args.rounds + 1):
        for name in list(forms)[r % 3 :] + list(forms)[: r % 3]:  # rotated order
            c0 = time.process_time()
            for i in range(args.layers):
                forms[name](i, strengths[r % 2], strengths[1 - r % 2])
            found.clear()
            if r:
                times[name].append((time.process_time() - c0) / args.layers)
    copy = benchutil.median(times["copy"])
    rows = [
        [name, f"{benchutil.median(t) * 1e3:.2f}", f"{benchutil.median(t) / copy:.2f}x"]
        for name, t in times.items()
    ]
    print(benchutil.table(["form", "CPU ms per layer per change (median)", "vs copy"], rows))


if __name__ == "__main__":
    main()
