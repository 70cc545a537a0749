"""Merge memory of a full-size SDXL UNet (fp16, CPU): undo records vs a full copy of every touched weight.

Model: UNet2DConditionModel from the real SDXL-base config (2.6 G parameters, ~4.8 GiB fp16), random weights
(uniform, std ≈ 0.023), saved once with `save_pretrained` and loaded by every variant with `from_pretrained`
(so `undo="source"` finds the file through config._name_or_path). Adapter: a rank-32 LoRA on every attention
(to_q/k/v/out.0) and feed-forward (ff.net.0.proj, ff.net.2) Linear, fp16 factors, ‖ΔW‖ = 2 % of ‖W‖ per layer
at strength 1 (a trained LoRA's usual order of magnitude).

Each variant runs in its own process (glibc's default malloc): load, build the LoRA, malloc_trim, then
  merge     loraweave.apply(unet, lora, mode="merge", strength=S, undo=KIND): time and peak RSS growth
            (/proc/self/clear_refs, VmHWM), then resident growth after malloc_trim(0)
  undo      handle.remove(): time, and a bitwise check of every touched weight (per-layer int64 bit sums and
            the first 4096 elements, taken before the merge)
Variants: "main" (loraweave before compact records: commit PRE15, the parent of the merge that brought them,
extracted with `git archive` to a temporary folder at run time; no undo argument: its full-copy record),
"copy" (a full copy of every touched weight, the same-run stand-in for it), "auto" (strength 1 and 4),
"source". Each child is killed when its RSS passes --max-rss-gib (a shared machine). Merge and undo report
wall and CPU seconds; on a loaded host the CPU time is the steadier one. --threads (default 2): torch threads
per child; with more runnable processes than cores, 2 threads spin in OpenMP barriers and run several times
slower than 1. Targets: resident growth <= 10 % of touched bytes (auto, strength 1), <= 1 % (source); peak
growth <= largest touched layer + 10 % of touched bytes (auto, strength 1); merge time <= 1.3x today's.

    .venv/bin/python benchmarks/bench_undo_sdxl.py [--dir DIR] [--keep]
        [--variants main,copy,auto,auto@4,source]
        [--threads 2] [--max-rss-gib 11]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CONFIG = "/work/shared/realdata/configs/sdxl-base__unet_config.json"
PRE15 = "052b54c"  # main before the merge of compact undo records (ce43030^1)
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
RANK, REL = 32, 0.02
HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def prepare(folder: str) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    torch.set_num_threads(2)
    with open(CONFIG) as f:
        config = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(
            config
        ).half()  # fp16 before any memory exists: 4.8 GiB, not 10
    unet.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in unet.parameters():
            p.uniform_(-0.04, 0.04, generator=g)
    unet.save_pretrained(folder, max_shard_size="1GB")  # shards: saving holds one shard's bytes at a time


def lora_for(unet) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    sd = {}
    for name, m in unet.named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith(TARGETS) and (".attn" in name or ".ff." in name):
            a = torch.randn(RANK, m.in_features, generator=g)
            b = torch.randn(m.out_features, RANK, generator=g)
            with torch.no_grad():  # under autograd each factor's graph kept an fp32 copy of W (9 GB in all)
                b *= REL * m.weight.float().norm() / (b @ a).norm()
            sd[f"{name}.lora_A.weight"], sd[f"{name}.lora_B.weight"] = a.half(), b.half()
    return sd


def _fingerprints(unet, names) -> dict:
    import torch

    out = {}
    for n in names:
        w = unet.get_submodule(n).weight.detach().view(torch.int16).view(-1)
        out[n] = (int(w.sum(dtype=torch.int64)), w[:4096].clone())
    return out


def child(variant: str, folder: str, threads: int) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    import loraweave

    torch.set_num_threads(threads)
    kind, _, strength = variant.partition("@")
    strength = float(strength or 1.0)
    unet = UNet2DConditionModel.from_pretrained(folder, torch_dtype=torch.float16, low_cpu_mem_usage=True)
    sd = lora_for(unet)
    names = sorted({k.rsplit(".lora_", 1)[0] for k in sd})
    touched = [unet.get_submodule(n).weight for n in names]
    touched_bytes = sum(w.numel() * w.element_size() for w in touched)
    largest = max(w.numel() * w.element_size() for w in touched)
    before = _fingerprints(unet, names)
    _trim()
    rss0 = _status_mib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    extra = {} if kind == "main" else {"undo": kind}
    t0, c0 = time.perf_counter(), time.process_time()
    handle = loraweave.apply(unet, sd, mode="merge", strength=strength, strict=True, **extra)
    merge_s, merge_cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = _status_mib("VmHWM") - rss0
    _trim()
    resident = _status_mib("VmRSS") - rss0
    kinds: dict[str, int] = {}
    for m in handle.report.applied:
        kinds[getattr(m, "undo", "copy") or "copy"] = kinds.get(getattr(m, "undo", "copy") or "copy", 0) + 1
    undo_bytes = handle.report.undo_bytes() if hasattr(handle.report, "undo_bytes") else touched_bytes
    t0, c0 = time.perf_counter(), time.process_time()
    handle.remove()
    undo_s, undo_cpu = time.perf_counter() - t0, time.process_time() - c0
    exact = all(
        a[0] == b[0] and torch.equal(a[1], b[1])
        for a, b in zip(_fingerprints(unet, names).values(), before.values(), strict=True)
    )
    print(
        json.dumps(
            {
                "variant": variant,
                "layers": len(names),
                "touched_mib": touched_bytes / 2**20,
                "largest_mib": largest / 2**20,
                "merge_s": merge_s,
                "merge_cpu": merge_cpu,
                "undo_s": undo_s,
                "undo_cpu": undo_cpu,
                "peak_mib": peak,
                "resident_mib": resident,
                "undo_mib": undo_bytes / 2**20,
                "kinds": kinds,
                "exact": exact,
            }
        )
    )


def pre15_src(tmp: str) -> str:
    """The src/ of commit PRE15, extracted under `tmp` (never committed: a baseline read at run time)."""
    out = os.path.join(tmp, "pre15")
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", os.path.dirname(HERE), "archive", PRE15, "src"], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    return os.path.join(out, "src")


def run_child(variant: str, folder: str, src: str, threads: int, max_rss_gib: float) -> dict:
    env = dict(os.environ, PYTHONPATH=src, SDNQ_USE_TORCH_COMPILE="0")
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(k, None)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        variant,
        "--dir",
        folder,
        "--threads",
        str(threads),
    ]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True)
        killed = _watch(proc, max_rss_gib)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if killed or proc.returncode != 0:
        why = (
            f"killed at {max_rss_gib} GiB RSS"
            if killed
            else f"returncode {proc.returncode}; -9: out of memory?"
        )
        raise RuntimeError(f"{variant} failed ({why}):\n{stderr[-3000:]}")
    return json.loads(stdout.strip().splitlines()[-1])


def _watch(proc: subprocess.Popen, max_rss_gib: float) -> bool:
    """Wait for the child; kill it (and say so) when its RSS passes the cap."""
    while proc.poll() is None:
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20
        except (OSError, StopIteration):
            rss = 0.0
        if rss > max_rss_gib:
            proc.kill()
            proc.wait()
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where the saved UNet lives (made when empty; default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the saved UNet")
    ap.add_argument("--variants", default="main,copy,auto,auto@4,source")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per child (default 2)")
    ap.add_argument("--max-rss-gib", type=float, default=11.0, help="kill a child whose RSS passes this")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.dir, args.threads)
        return
    folder = args.dir or tempfile.mkdtemp(prefix="loraweave-sdxl-")
    scratch = tempfile.mkdtemp(prefix="loraweave-pre15-")
    try:
        if not os.path.exists(os.path.join(folder, "config.json")):
            t0 = time.perf_counter()
            subprocess.run(
                [
                    sys.executable,
                    "-c",
                    f"import sys; sys.path.insert(0, {HERE!r}); "
                    f"import bench_undo_sdxl as b; b.prepare({folder!r})",
                ],
                check=True,
            )
            print(f"prepared {folder} in {time.perf_counter() - t0:.0f} s")
        results = {}
        print(f"threads per child: {args.threads}", flush=True)
        for v in args.variants.split(","):
            try:
                src = pre15_src(scratch) if v == "main" else SRC
                results[v] = run_child(v, folder, src, args.threads, args.max_rss_gib)
            except RuntimeError as exc:  # one variant out of memory on a shared machine: report the others
                print(f"variant {v}: {exc}", flush=True)
                continue
            print(json.dumps(results[v]), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep and not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    report(results)


def report(results: dict) -> None:
    any_r = next(iter(results.values()))
    touched, largest = any_r["touched_mib"], any_r["largest_mib"]
    base, copy = results.get("main"), results.get("copy")

    def ratio(r: dict, ref: dict | None, key: str) -> str:
        return f"{r[key] / ref[key]:.2f}x" if ref else "-"

    print(
        f"\nSDXL UNet fp16: {any_r['layers']} touched layers, {touched:.0f} MiB touched, largest "
        f"{largest:.1f} MiB"
    )
    print(
        f"{'variant':<8} {'merge s':>7} {'cpu s':>6} {'wall/main':>9} {'cpu/main':>8} {'wall/copy':>9} "
        f"{'cpu/copy':>8} {'undo s':>6} {'undo cpu':>8} {'peak MiB':>8} {'resident MiB':>12} "
        f"{'res/touched':>11} {'record MiB':>10} "
        "exact kinds"
    )
    for v, r in results.items():
        print(
            f"{v:<8} {r['merge_s']:7.1f} {r['merge_cpu']:6.1f} {ratio(r, base, 'merge_s'):>9} "
            f"{ratio(r, base, 'merge_cpu'):>8} {ratio(r, copy, 'merge_s'):>9} "
            f"{ratio(r, copy, 'merge_cpu'):>8} {r['undo_s']:6.1f} {r['undo_cpu']:8.1f} {r['peak_mib']:8.0f} "
            f"{r['resident_mib']:12.0f} {r['resident_mib'] / touched:11.3f} {r['undo_mib']:10.0f} "
            f"{r['exact']} {r['kinds']}"
        )
    checks = []
    if "auto" in results:
        a = results["auto"]
        checks.append(("resident growth auto <= 10% touched", a["resident_mib"] <= 0.10 * touched))
        checks.append(
            ("peak growth auto <= largest + 10% touched", a["peak_mib"] <= largest + 0.10 * touched)
        )
        for name, ref in (("main", base), ("copy", copy)):
            for key in ("merge_s", "merge_cpu") if ref else ():
                checks.append(
                    (f"merge {key} auto <= 1.3x {name} ({a[key] / ref[key]:.2f}x)", a[key] <= 1.3 * ref[key])
                )
    if "source" in results:
        checks.append(
            ("resident growth source <= 1% touched", results["source"]["resident_mib"] <= 0.01 * touched)
        )
    for name, ok in checks:
        print(f"target: {name}: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
