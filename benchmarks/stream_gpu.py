"""Layer streaming on a CUDA device: a Flux-shaped transformer at budgets of 100/50/25 % of its size.

One command on a machine with a CUDA device:

    .venv/bin/python benchmarks/stream_gpu.py                 # Flux widths, 8 double + 16 single blocks, bf16
    .venv/bin/python benchmarks/stream_gpu.py --double 19 --single 38   # the full Flux.1 stack (24 GB bf16)

Measures, in one run:
- host-to-device bandwidth of the device (pinned 1 GiB copy, best of 5), the ceiling for streaming;
- step time of the fully resident model (batch 2 = classifier-free guidance, 1024x1024 latents: 4096 image +
  512 text tokens), with a runtime LoRA on every Linear;
- for each budget and placement (prefix / spread resident blocks): step time and its ratio to resident, the
  plan (resident/streamed blocks), bytes copied per step, achieved copy bandwidth vs measured H2D,
  copy/compute overlap, and correctness vs resident (bit-equal and max |diff|), before and after a strength
  change.
Target (issue 8): at 50 % budget >= 0.8x the resident throughput.

Without CUDA it exits with status 2 and says so. `--tiny --device cpu` runs the same code on a tiny stack on
CPU (a smoke test of this script; its times mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--double", type=int, default=8, help="double-stream blocks (Flux.1: 19)")
    ap.add_argument("--single", type=int, default=16, help="single-stream blocks (Flux.1: 38)")
    ap.add_argument("--budgets", default="1.0,0.5,0.25", help="fractions of the model's size")
    ap.add_argument(
        "--placements",
        default="prefix,spread",
        help="resident-block placements to compare below 100 %% (prefix: sd.cpp's rule; spread)",
    )
    ap.add_argument("--steps", type=int, default=5, help="timed steps per setting (after 2 warm-up steps)")
    ap.add_argument("--rank", type=int, default=16, help="runtime LoRA rank on every Linear (0: no LoRA)")
    ap.add_argument("--tokens", type=int, default=4096, help="image tokens (4096 = 1024x1024)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (script smoke test)")
    ap.add_argument("--out", help="also write the results as JSON here")
    return ap.parse_args()


def build(args, device: torch.device, dtype: torch.dtype):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    if args.tiny:
        torch.set_num_threads(1)  # tiny CPU matmuls: threads only contend
        cfg = dict(
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 6, 6],
            in_channels=16,
        )
    else:
        cfg = dict(
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56],
            in_channels=64,
        )
    with torch.device(device):  # initialised on the device: seconds, not minutes of CPU init
        model = FluxTransformer2DModel(
            patch_size=1, num_layers=args.double, num_single_layers=args.single, guidance_embeds=True, **cfg
        )
    return model.to(dtype).eval().requires_grad_(False), cfg


def inputs(args, cfg, device, dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(1)
    img, txt = (16, 5) if args.tiny else (args.tokens, 512)
    t = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    return dict(
        hidden_states=t(2, img, cfg["in_channels"]),
        encoder_hidden_states=t(2, txt, cfg["joint_attention_dim"]),
        pooled_projections=t(2, cfg["pooled_projection_dim"]),
        timestep=torch.full((2,), 0.5, device=device),
        guidance=torch.full((2,), 3.5, device=device),
        img_ids=torch.zeros(img, 3, device=device),
        txt_ids=torch.zeros(txt, 3, device=device),
        return_dict=False,
    )


def lora(model, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, m.in_features, generator=g) * 0.01
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(m.out_features, rank, generator=g) * 0.01
    return sd


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    host = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return host.numel() / best


def step_times(model, kw, device, steps: int) -> tuple[list[float], torch.Tensor]:
    with torch.no_grad():
        for _ in range(2):
            out = model(**kw)[0]
        times = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            out = model(**kw)[0]
            sync(device)
            times.append(time.perf_counter() - t0)
    return times, out


def main() -> int:
    args = parse()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "stream_gpu.py: no CUDA device on this machine; this benchmark measures host-to-device streaming "
            "and needs one (use --tiny --device cpu for a smoke run of the script).",
            file=sys.stderr,
        )
        return 2
    if device.type != "cuda" and not args.tiny:
        print("stream_gpu.py: CPU runs are only a smoke test; add --tiny", file=sys.stderr)
        return 2
    import loraweave
    from loraweave.streaming import stream

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, cfg = build(args, device, dtype)
    # Sized as the planner counts it (each tensor 256-byte aligned in a slot), so 100 % holds everything.
    size = sum(
        (t.numel() * t.element_size() + 255) // 256 * 256 for t in [*model.parameters(), *model.buffers()]
    )
    kw = inputs(args, cfg, device, dtype)
    results: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "blocks": {"double": args.double, "single": args.single},
        "weight_bytes": size,
        "h2d_bytes_per_s": h2d_bandwidth(device),
        "lora_rank": args.rank,
        "settings": [],
    }
    handle = loraweave.apply(model, lora(model, args.rank), mode="runtime") if args.rank else None
    # Budgets are fractions of everything the model needs on the device: weights + LoRA factors (as the
    # planner lays them out: down/up 256-aligned, travelling with their block, plus the per-rank scales).
    from loraweave.streaming import factors

    al = lambda n: (n + 255) // 256 * 256  # noqa: E731
    factor_bytes = sum(
        al(factors.path_bytes(p) - factors.scale_bytes(p)) + 256 + factors.scale_bytes(p)
        for p in factors.runtime_paths(model)
    )
    results["factor_bytes"] = factor_bytes
    size += factor_bytes
    name = next(iter(handle.strengths)) if handle else None
    times, want = step_times(model, kw, device, args.steps)
    resident = statistics.median(times)
    if handle:
        handle.set_strength(name, 0.5)
        _, want_half = step_times(model, kw, device, 1)
        handle.set_strength(name, 1.0)
    results["resident_step_s"] = resident
    print(
        f"resident: {resident * 1e3:.1f} ms/step  weights+LoRA {size / 2**30:.2f} GiB  "
        f"H2D {results['h2d_bytes_per_s'] or 0:.3g} B/s",
        flush=True,
    )
    placements = args.placements.split(",")
    settings = [
        (float(f), p)
        for f in args.budgets.split(",")
        for p in (placements[:1] if float(f) >= 1 else placements)
    ]
    for frac, placement in settings:
        s = stream(model, budget=int(size * frac), device=device, margin=0, placement=placement)
        times, out = step_times(model, kw, device, args.steps)
        report = s.sync_report()
        row = {
            "budget_fraction": frac,
            "placement": placement,
            "step_s": statistics.median(times),
            "throughput_vs_resident": resident / statistics.median(times),
            "bit_equal": bool(torch.equal(out, want)),
            "max_abs_diff": float((out.float() - want.float()).abs().max()),
            "resident_blocks": sum(s.plan.resident),
            "streamed_blocks": len(s.plan.streamed),
            "bytes_per_step": report.last.bytes_copied,
            "copy_bytes_per_s": report.copy_bandwidth,
            "overlap": report.overlap,
            "peak_ledger_bytes": report.peak_bytes,
            "plan": s.plan.summary(),
        }
        if handle:  # a strength change between steps, prefetch on: still equal to resident
            handle.set_strength(name, 0.5)
            with torch.no_grad():
                row["bit_equal_after_strength_change"] = bool(torch.equal(model(**kw)[0], want_half))
            handle.set_strength(name, 1.0)
        if results["h2d_bytes_per_s"] and row["copy_bytes_per_s"]:
            row["copy_vs_h2d"] = row["copy_bytes_per_s"] / results["h2d_bytes_per_s"]
        results["settings"].append(row)
        print(
            f"budget {frac:>4.0%} {placement:>6}: {row['step_s'] * 1e3:.1f} ms/step  "
            f"x{row['throughput_vs_resident']:.2f} of "
            f"resident  streamed {row['streamed_blocks']}/{len(s.plan.resident)}  "
            f"{row['bytes_per_step'] / 2**30:.2f} GiB/step  copy {row['copy_bytes_per_s'] or 0:.3g} B/s  "
            f"overlap {row['overlap'] if row['overlap'] is not None else 'n/a'}  equal {row['bit_equal']}",
            flush=True,
        )
        s.close()
    half = [r for r in results["settings"] if r["budget_fraction"] == 0.5]
    if half:
        results["target_50pct_ge_0.8x"] = {r["placement"]: r["throughput_vs_resident"] >= 0.8 for r in half}
    print(json.dumps(results, indent=1, default=str))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
