"""`loraweave inspect DIR` over 50 adapters in one process, vs one `inspect FILE` process per file.

Folder: the 8 real files of /work/shared/realdata/lora, 6 symlinks each (SD1/SD2 kohya LoKr, diffusers,
cloneofsimo, Flux PEFT), plus 2 copies of bench_inspect.py's 1000-key kohya Flux + CLIP-L file: 50 adapters.
Each run is a fresh child process (`python -m loraweave inspect DIR --json`); the skeleton cache is filled by
a discarded round 0.

  total           wall time of the whole command, Python start-up and imports included
  first file      in-process seconds of the first file (builds that architecture's skeleton and alias tables)
  per file after  the other 49 files' in-process seconds: mean and median (target < 0.2 s each)
  one process     `inspect FILE --json` as its own process, median over the 8 real files (what a shell loop
                  pays)
  CPU s           user + system CPU seconds of those child processes (robust to a busy machine)

    .venv/bin/python benchmarks/bench_inspect_dir.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_inspect import make_file  # noqa: E402

REAL = Path("/work/shared/realdata/lora")
TARGET_S = 0.2


def build_folder(folder: Path) -> list[Path]:
    real = sorted(REAL.glob("*.safetensors"))
    for copy in range(6):
        for path in real:
            (folder / f"{copy}_{path.name}").symlink_to(path)
    flux = make_file(folder)
    shutil.copy(flux, folder / "flux_1000_b.safetensors")
    return real


def _child_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run(cmd: list[str]) -> tuple[float, str, float]:
    """(wall seconds, stdout, CPU seconds of the child: user + system, which a busy machine does not
    inflate)."""
    t0, c0 = time.perf_counter(), _child_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall, cpu = time.perf_counter() - t0, _child_cpu() - c0
    if proc.returncode not in (0, 1):
        raise RuntimeError(proc.stderr[-2000:])
    return wall, proc.stdout, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-inspect-dir-"))
    os.environ["LORAWEAVE_CACHE"] = str(folder / ".skeletons")
    adapters = folder / "loras"
    adapters.mkdir()
    try:
        real = build_folder(adapters)
        py = sys.executable
        folder_cmd = [py, "-m", "loraweave", "inspect", str(adapters), "--json"]
        totals, firsts, after_mean, after_median, singles, cpu_dir, cpu_single = [], [], [], [], [], [], []
        for r in range(args.rounds + 1):  # round 0 fills the skeleton cache and page cache: discarded
            wall, out, cpu = run(folder_cmd)
            rows = json.loads(out)
            assert len(rows) == 50 and not any("error" in x for x in rows), "every file must inspect"
            secs = [x["seconds"] for x in rows]
            if r:
                totals.append(wall)
                cpu_dir.append(cpu)
                firsts.append(secs[0])
                after_mean.append(statistics.mean(secs[1:]))
                after_median.append(statistics.median(secs[1:]))
                for p in real:
                    wall1, _, cpu1 = run([py, "-m", "loraweave", "inspect", str(p), "--json"])
                    singles.append(wall1)
                    cpu_single.append(cpu1)
            print(f"round {r} done", file=sys.stderr)
        med = statistics.median
        print(f"{'measure':<34} {'median s':>9}")
        print(f"{'inspect DIR, 50 files, total':<34} {med(totals):>9.2f}")
        print(f"{'  first file (in process)':<34} {med(firsts):>9.3f}")
        print(f"{'  per file after the first, mean':<34} {med(after_mean):>9.3f}")
        print(f"{'  per file after the first, median':<34} {med(after_median):>9.3f}")
        print(f"{'inspect FILE, one process per file':<34} {med(singles):>9.2f}")
        print(f"{'CPU s, inspect DIR 50 files':<34} {med(cpu_dir):>9.2f}")
        print(f"{'CPU s, inspect FILE process':<34} {med(cpu_single):>9.2f}")
        print(
            f"per file after the first: {med(after_mean):.3f} s (target < {TARGET_S} s); the folder in one "
            f"process costs {med(totals) / (50 * med(singles)):.3f}x of 50 separate processes "
            f"({50 * med(singles):.0f} s estimated)"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
