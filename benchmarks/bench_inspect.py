"""`loraweave inspect` of a 1000-key LoRA against full-size Flux, end to end including Python start-up
(target: < 2 s).

File: the real 912-key kohya Flux key list (/work/shared/realdata/keys/invokeai/flux_lora_kohya_format.json,
names and shapes; random bf16 values) plus 44 CLIP-L text-encoder modules as down/up pairs (88 keys): 1000
keys. Each variant is a fresh child process, run round-robin; medians are reported. Round 0 (discarded) also
writes the architecture skeleton cache (in the temp folder), so the timed rounds measure the cached path: no
diffusers import.

  python start     python -c pass
  import           python -c "import loraweave.tools.inspect"  (what every CLI call pays before any work)
  inspect --arch   python -m loraweave.cli inspect FILE --arch flux --json   (Flux transformer + CLIP-L + T5)
  inspect, no TE   the same with --no-text-encoders
  inspect detect   python -m loraweave.cli inspect FILE --json  (architecture from the keys)
  import loraweave python -c "import loraweave"  (no torch)
  import torch     python -c "import torch"  (the floor of every path that imports torch: coverage does today)
Each row gives the wall median and the children's CPU seconds (user + system; less inflated by a busy host).
  inspect no cov   python -m loraweave.cli inspect FILE --no-coverage --json  (the file alone, no torch)

    .venv/bin/python benchmarks/bench_inspect.py [--rounds 5]
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

import torch

KEYS = Path("/work/shared/realdata/keys/invokeai/flux_lora_kohya_format.json")
TE_PROJ = ("self_attn_q_proj", "self_attn_k_proj", "self_attn_v_proj", "self_attn_out_proj")
TARGET_S = 2.0


def make_file(folder: Path) -> Path:
    from loraweave.io.write import save_file

    shapes = json.loads(KEYS.read_text())
    shapes = shapes.get("keys", shapes)
    g = torch.Generator().manual_seed(0)
    sd = {
        k: (torch.randn(v, generator=g) * 0.01).to(torch.bfloat16) if v else torch.tensor(16.0)
        for k, v in shapes.items()
    }
    for layer in range(11):
        for proj in TE_PROJ:
            stem = f"lora_te1_text_model_encoder_layers_{layer}_{proj}"
            sd[f"{stem}.lora_down.weight"] = torch.randn(16, 768, generator=g).to(torch.bfloat16)
            sd[f"{stem}.lora_up.weight"] = torch.randn(768, 16, generator=g).to(torch.bfloat16)
    path = folder / "flux_1000.safetensors"
    save_file(sd, path)
    assert len(sd) == 1000, len(sd)
    return path


def _child_cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def run(cmd: list[str], env: dict | None = None) -> tuple[float, str, float]:
    """(wall seconds, stdout, CPU seconds of the child: user + system, which a busy host does not inflate
    much)."""
    t0, c0 = time.perf_counter(), _child_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - t0, _child_cpu() - c0
    if proc.returncode not in (0, 1):
        raise RuntimeError(proc.stderr[-2000:])
    return wall, proc.stdout, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-inspect-"))
    os.environ["LORAWEAVE_CACHE"] = str(folder / "skeletons")  # children inherit: round 0 fills it
    try:
        path = make_file(folder)
        py = sys.executable
        variants = {
            "python start": [py, "-c", "pass"],
            "import": [py, "-c", "import loraweave.tools.inspect"],
            "import loraweave": [py, "-c", "import loraweave"],
            "import torch": [py, "-c", "import torch"],
            "inspect no cov": [py, "-m", "loraweave.cli", "inspect", str(path), "--no-coverage", "--json"],
            "inspect --arch": [py, "-m", "loraweave.cli", "inspect", str(path), "--arch", "flux", "--json"],
            "inspect, no TE": [
                py,
                "-m",
                "loraweave.cli",
                "inspect",
                str(path),
                "--arch",
                "flux",
                "--json",
                "--no-text-encoders",
            ],
            "inspect detect": [py, "-m", "loraweave.cli", "inspect", str(path), "--json"],
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        cpus: dict[str, list[float]] = {k: [] for k in variants}
        last = ""
        load0 = f"{os.getloadavg()[0]:.2f}"
        for r in range(args.rounds + 1):  # round 0 warms the page cache and .pyc files: discarded
            names = list(variants)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                wall, out, cpu = run(variants[name])
                if r:
                    times[name].append(wall)
                    cpus[name].append(cpu)
                if name == "inspect --arch":
                    last = out
            print(f"round {r} done", file=sys.stderr)
        cov = json.loads(last)["coverage"]
        cold = run(
            [py, "-m", "loraweave.cli", "inspect", str(path), "--arch", "flux", "--json"],
            {**os.environ, "LORAWEAVE_CACHE": "0"},
        )[0]
        print(f"load average before/after: {load0} / {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
        print(f"{'variant':<16} {'median s':>9} {'min s':>7} {'median CPU s':>13}")
        for name, ts in times.items():
            print(
                f"{name:<16} {statistics.median(ts):>9.2f} {min(ts):>7.2f} "
                f"{statistics.median(cpus[name]):>13.2f}"
            )
        print(
            f"coverage: {cov['keys_applied']}/{cov['keys_total']} keys land on {cov['against']}; "
            f"in-process inspect time {json.loads(last)['seconds']:.2f}s; target end to end < {TARGET_S} s"
        )
        print(
            f"without the skeleton cache (builds Flux + CLIP + T5 through diffusers/transformers): "
            f"{cold:.2f}s"
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
