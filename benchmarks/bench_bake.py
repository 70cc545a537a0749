"""`loraweave bake` of a synthetic bf16 checkpoint (default 4 GiB): wall time against a plain file copy, and
the peak RSS of the bake process against the largest tensor (target: < 1 GiB above it).

The checkpoint is one .safetensors file of Flux-sized bf16 Linear weights (3072x3072, 3072x12288, 12288x3072,
9216x3072; largest 72 MiB), written to a temp folder; the LoRA (rank 16, bf16, bare module names) touches
every third weight. Each variant runs in its own child process (`/usr/bin/time -f %M` gives its peak RSS); the
order alternates between rounds and the page cache is warm for both (the input was just written).

  copy        shutil.copyfile(input, out)            (copy_file_range / sendfile: the I/O floor)
  bake        python -m loraweave.cli bake input lora -o out --quiet
  bake start  the same process importing loraweave.tools.bake and exiting: Python + torch start-up and RSS

    .venv/bin/python benchmarks/bench_bake.py [--size-gb 4] [--rounds 2] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = ((3072, 3072), (12288, 3072), (3072, 12288), (9216, 3072))


def make_checkpoint(folder: Path, size_gb: float) -> tuple[Path, Path, int, int]:
    from loraweave.io.write import StreamingWriter

    entries, total, i = [], 0, 0
    while total < size_gb * 2**30:
        shape = SHAPES[i % len(SHAPES)]
        entries.append((f"blocks.{i}.linear.weight", torch.bfloat16, shape))
        total += shape[0] * shape[1] * 2
        i += 1
    block = torch.randn(12288 * 3072, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ckpt = folder / "model.safetensors"
    writer = StreamingWriter(ckpt, entries, {"format": "pt"})
    for n, (name, _, shape) in enumerate(entries):
        # one random block reused, shifted per tensor: real bytes at disk speed without 4 GB of randn
        t = block[: shape[0] * shape[1]].roll(n).view(shape)
        writer.write(name, t)
    writer.close()
    g = torch.Generator().manual_seed(1)
    lora = {}
    for name, _, shape in entries[::3]:
        stem = name[: -len(".weight")]
        lora[f"{stem}.lora_A.weight"] = (torch.randn(16, shape[1], generator=g) * 0.01).to(torch.bfloat16)
        lora[f"{stem}.lora_B.weight"] = (torch.randn(shape[0], 16, generator=g) * 0.01).to(torch.bfloat16)
    from loraweave.io.write import save_file

    save_file(lora, folder / "lora.safetensors")
    largest = max(s[0] * s[1] * 2 for _, _, s in entries)
    return ckpt, folder / "lora.safetensors", total, largest


def timed(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of a child process."""
    t0 = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return wall, int(proc.stderr.strip().splitlines()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", help="folder to build in (kept); default: a temp folder, deleted")
    args = ap.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-bake-", dir="/tmp"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        ckpt, lora, total, largest = make_checkpoint(folder, args.size_gb)
        print(
            f"checkpoint {total / 2**30:.2f} GiB bf16, largest tensor {largest / 2**20:.0f} MiB, "
            f"LoRA {lora.stat().st_size / 2**20:.0f} MiB; built in {time.perf_counter() - t0:.1f}s",
            file=sys.stderr,
        )
        py = sys.executable
        copy_cmd = [
            py,
            "-c",
            f"import shutil; shutil.copyfile({str(ckpt)!r}, {str(folder / 'copy.safetensors')!r})",
        ]
        bake_cmd = [
            py,
            "-m",
            "loraweave.cli",
            "bake",
            str(ckpt),
            str(lora),
            "-o",
            str(folder / "baked.safetensors"),
            "--quiet",
            "--force",
        ]
        start_cmd = [py, "-c", "import loraweave.tools.bake"]
        results: dict[str, list[tuple[float, float]]] = {"copy": [], "bake": [], "bake start": []}
        for r in range(args.rounds):
            order = [("copy", copy_cmd), ("bake", bake_cmd), ("bake start", start_cmd)]
            for name, cmd in order if r % 2 == 0 else order[::-1]:
                results[name].append(timed(cmd))
                print(
                    f"round {r} {name}: {results[name][-1][0]:.2f}s {results[name][-1][1]:.0f} MiB",
                    file=sys.stderr,
                )
                for f in ("copy.safetensors", "baked.safetensors"):
                    (folder / f).unlink(missing_ok=True)
        print(f"{'variant':<12} {'wall s (median)':>16} {'peak RSS MiB':>13}")
        med = {k: (statistics.median(w for w, _ in v), max(m for _, m in v)) for k, v in results.items()}
        for k, (w, m) in med.items():
            print(f"{k:<12} {w:>16.2f} {m:>13.0f}")
        over = med["bake"][1] - largest / 2**20
        print(
            f"bake / copy wall: {med['bake'][0] / med['copy'][0]:.2f}x; bake peak RSS - largest tensor: "
            f"{over:.0f} MiB (target < 1024); of which start-up: {med['bake start'][1]:.0f} MiB"
        )
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
