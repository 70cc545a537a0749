"""The heatmap data of `inspect --plot` (and the ComfyUI Inspect node) for the real 350-layer SD1 LoKr
(KohakuBlueleaf smart_falcon_4_lokr, 650 KB): ‖ΔW‖ per module from the factors vs ΔW formed (issue 43 G).

  factor norms   block_grid(FILE): LoKr's squared_norm (row norms of w1 and w2, no kron)
  formed, blocks the same grid with LoKr's formula switched off: ΔW formed FORMED_BLOCK elements at a time
                 (what a family without a formula, e.g. LoHa, takes)
  formed, whole  ΔW of each layer formed whole (FORMED_BLOCK unbounded): the method before the fix, which
                 allocated and freed up to 1280 x 11520 fp32 (+ its fp64 copy) per layer

The process keeps glibc's malloc defaults (no benchutil re-exec), as `loraweave inspect` and ComfyUI run:
the page faults of layer-sized temporaries are what the old method paid. Each variant runs once per round in
rotated order; medians of wall, user and system seconds and minor page faults, and each median's ratio to
`factor norms` in the same run. torch's default thread count.

    .venv/bin/python benchmarks/bench_heatmap.py [--rounds 3]   (~1-2 min on a quiet 2-core host)
"""

from __future__ import annotations

import os

os.environ["LORAWEAVE_BENCH_NO_REEXEC"] = "1"  # before benchutil: keep glibc's default malloc

import argparse  # noqa: E402
import contextlib  # noqa: E402
import resource  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import header, median, table  # noqa: E402

from loraweave.families import FAMILIES  # noqa: E402
from loraweave.tools import plot  # noqa: E402

FILE = Path("/work/shared/realdata/lora/KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors")


@contextlib.contextmanager
def formed(block: int):
    """LoKr's factor-norm formula off and ΔW formed `block` elements at a time, inside the block."""
    lokr, saved = FAMILIES["lokr"], (FAMILIES["lokr"].squared_norm, plot.FORMED_BLOCK)
    lokr.squared_norm, plot.FORMED_BLOCK = (lambda f, src, length: None), block
    try:
        yield
    finally:
        lokr.squared_norm, plot.FORMED_BLOCK = saved


def timed(variant: str) -> tuple[dict[str, float], list]:
    """(wall/user/sys seconds and minor faults of one grid, its values)."""
    ctx = {
        "factor norms": contextlib.nullcontext(),
        "formed, blocks": formed(plot.FORMED_BLOCK),
        "formed, whole": formed(1 << 62),
    }[variant]
    with ctx:
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        grid = plot.block_grid(FILE)
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cost = {
        "wall": wall,
        "user": r1.ru_utime - r0.ru_utime,
        "sys": r1.ru_stime - r0.ru_stime,
        "faults": float(r1.ru_minflt - r0.ru_minflt),
    }
    return cost, grid.values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    header(f"heatmap grid of {FILE.name} ({FILE.stat().st_size // 1024} KiB), load {os.getloadavg()}")
    names = ["factor norms", "formed, blocks", "formed, whole"]
    timed("factor norms")  # warm-up: imports, the cached skeleton
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    reference = None
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            cost, values = timed(name)
            runs[name].append(cost)
            flat = [v for row in values for v in row if v is not None]
            reference = reference or flat
            worst = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(flat, reference, strict=True))
            print(
                f"round {r} {name}: {cost['wall']:.2f} s, max rel diff to first {worst:.1e}", file=sys.stderr
            )
    base = {k: median([c[k] for c in runs[names[0]]]) for k in ("wall", "user", "sys", "faults")}
    rows = []
    for name in names:
        med = {k: median([c[k] for c in runs[name]]) for k in base}
        rows.append(
            [
                name,
                f"{med['wall']:.2f}",
                f"{med['wall'] / base['wall']:.1f}x",
                f"{med['user']:.2f}",
                f"{med['sys']:.2f}",
                f"{med['faults']:.0f}",
                f"{med['faults'] / max(base['faults'], 1):.0f}x",
            ]
        )
    print(f"medians of {args.rounds} rounds (glibc default malloc)")
    print(table(["variant", "wall s", "vs factor", "user s", "sys s", "minor faults", "vs factor"], rows))


if __name__ == "__main__":
    main()
