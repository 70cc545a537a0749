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
Variants: "main" (the loraweave in /work/main/src, no undo argument: today's full-copy record, the baseline),
"copy", "auto" (strength 1 and 4), "source".
Targets: resident growth <= 10 % of touched bytes (auto, strength 1), <= 1 % (source); peak growth <= largest
touched layer + 10 % of touched bytes (auto, strength 1); merge time <= 1.3x today's.

    .venv/bin/python benchmarks/bench_undo_sdxl.py [--dir DIR] [--keep] [--variants main,copy,auto,auto@4,source]
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
MAIN_SRC = "/work/main/src"
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
        unet = UNet2DConditionModel.from_config(config).half()  # fp16 before any memory exists: 4.8 GiB, not 10
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


def child(variant: str, folder: str) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    import loraweave

    torch.set_num_threads(2)
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
    t0 = time.perf_counter()
    handle = loraweave.apply(unet, sd, mode="merge", strength=strength, strict=True, **extra)
    merge_s = time.perf_counter() - t0
    peak = _status_mib("VmHWM") - rss0
    _trim()
    resident = _status_mib("VmRSS") - rss0
    kinds: dict[str, int] = {}
    for m in handle.report.applied:
        kinds[getattr(m, "undo", "copy") or "copy"] = kinds.get(getattr(m, "undo", "copy") or "copy", 0) + 1
    undo_bytes = handle.report.undo_bytes() if hasattr(handle.report, "undo_bytes") else touched_bytes
    t0 = time.perf_counter()
    handle.remove()
    undo_s = time.perf_counter() - t0
    exact = all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(_fingerprints(unet, names).values(),
                                                                         before.values(), strict=True))
    print(json.dumps({"variant": variant, "layers": len(names), "touched_mib": touched_bytes / 2**20,
                      "largest_mib": largest / 2**20, "merge_s": merge_s, "undo_s": undo_s, "peak_mib": peak,
                      "resident_mib": resident, "undo_mib": undo_bytes / 2**20, "kinds": kinds, "exact": exact}))


def run_child(variant: str, folder: str) -> dict:
    env = dict(os.environ, PYTHONPATH=MAIN_SRC if variant == "main" else SRC, SDNQ_USE_TORCH_COMPILE="0")
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant, "--dir", folder],
                         env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{variant} failed (returncode {res.returncode}; -9: killed, out of memory?):\n"
                           f"{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="where the saved UNet lives (made when empty; default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the saved UNet")
    ap.add_argument("--variants", default="main,copy,auto,auto@4,source")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.dir)
        return
    folder = args.dir or tempfile.mkdtemp(prefix="loraweave-sdxl-")
    try:
        if not os.path.exists(os.path.join(folder, "config.json")):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                            f"import bench_undo_sdxl as b; b.prepare({folder!r})"], check=True)
            print(f"prepared {folder} in {time.perf_counter() - t0:.0f} s")
        results = {}
        for v in args.variants.split(","):
            try:
                results[v] = run_child(v, folder)
            except RuntimeError as exc:  # one variant out of memory on a shared machine: report the others
                print(f"variant {v}: {exc}", flush=True)
                continue
            print(json.dumps(results[v]), flush=True)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    report(results)


def report(results: dict) -> None:
    any_r = next(iter(results.values()))
    touched, largest = any_r["touched_mib"], any_r["largest_mib"]
    base = results.get("main")
    print(f"\nSDXL UNet fp16: {any_r['layers']} touched layers, {touched:.0f} MiB touched, largest {largest:.1f} MiB")
    print(f"{'variant':<9} {'merge s':>8} {'vs main':>8} {'undo s':>7} {'peak MiB':>9} {'resident MiB':>13} "
          f"{'res/touched':>11} {'undo MiB':>9} exact kinds")
    for v, r in results.items():
        ratio = f"{r['merge_s'] / base['merge_s']:.2f}x" if base else "-"
        print(f"{v:<9} {r['merge_s']:8.1f} {ratio:>8} {r['undo_s']:7.1f} {r['peak_mib']:9.0f} {r['resident_mib']:13.0f} "
              f"{r['resident_mib'] / touched:11.3f} {r['undo_mib']:9.0f} {r['exact']} {r['kinds']}")
    checks = []
    if "auto" in results:
        a = results["auto"]
        checks.append(("resident growth auto <= 10% touched", a["resident_mib"] <= 0.10 * touched))
        checks.append(("peak growth auto <= largest + 10% touched", a["peak_mib"] <= largest + 0.10 * touched))
        if base:
            checks.append((f"merge time auto <= 1.3x main ({a['merge_s'] / base['merge_s']:.2f}x)",
                           a["merge_s"] <= 1.3 * base["merge_s"]))
    if "source" in results:
        checks.append(("resident growth source <= 1% touched", results["source"]["resident_mib"] <= 0.01 * touched))
    for name, ok in checks:
        print(f"target: {name}: {'PASS' if ok else 'FAIL'}")


if __name__ == "__main__":
    main()
