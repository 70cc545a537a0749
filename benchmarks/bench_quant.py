"""Adapters on quantized bases (SDNQ): apply time, extra memory, retention and step-time overhead per mechanism,
and hosted apply fresh vs factor-cache replay on a many-layer model.

Part 1: one Linear(3072, 3072) quantized by SDNQ (uint4 group 64, and int8 rowwise), input 4096 tokens, a rank-16
LoRA (and a LoKr of the same size for hosting). Per (config, mechanism):
  apply ms      median wall time of apply (remove untimed)
  extra MiB     resident bytes the mechanism adds: side-channel growth (factor, hosted), runtime factors,
                or the original quantized tensors kept for the exact undo (requantize)
  retention     ρ = <applied Δ, intended Δ>/‖intended Δ‖² from the report (factor: exact = 1)
  step ×        forward time with the adapter / forward time of the quantized layer alone (paired per round)
Part 2: hosted apply of a LoKr on every layer of an N-layer stack of Linear(D, D) uint4 layers: fresh (cache
miss, factors computed and written) vs replay (cache hit), plus the bit-identity of the two.

    .venv/bin/python benchmarks/bench_quant.py [--quick] [--rounds N] [--layers 60] [--dim 1024]
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
import time

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, header, interleaved, median, parse_args, ratio_median, table

os.environ.setdefault("SDNQ_USE_TORCH_COMPILE", "0")

IN = OUT = 3072
TOKENS = 4096
RANK = 16
CONFIGS = {"uint4": dict(weights_dtype="uint4"), "int8": dict(weights_dtype="int8")}


def quantize(model: torch.nn.Module, cfg: dict) -> torch.nn.Module:
    from sdnq import sdnq_post_load_quant

    with torch.random.fork_rng():
        sdnq_post_load_quant(model, add_skip_keys=False, **cfg)
    return model


def adapters(g: torch.Generator, name: str, dim: int) -> tuple[dict, dict]:
    lora = {f"{name}.lora_down.weight": torch.randn(RANK, dim, generator=g) / dim**0.5,
            f"{name}.lora_up.weight": torch.randn(dim, RANK, generator=g) * 0.01,
            f"{name}.alpha": torch.tensor(float(RANK))}
    side = int(round(dim**0.5))
    side = next(s for s in range(side, 0, -1) if dim % s == 0)
    lokr = {f"{name}.lokr_w1": torch.randn(side, side, generator=g) * 0.05,
            f"{name}.lokr_w2": torch.randn(dim // side, dim // side, generator=g) * 0.05 / side}
    return lora, lokr


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def extra_bytes(handle, layer, before: int) -> int:
    if handle._runtime:
        rp = handle._runtime[0]
        return nbytes(rp.down, rp.up)
    write = handle._quant[0]
    if write.mechanism == "requantize":
        return nbytes(*[t for t in (getattr(layer, k, None) for k in ("weight", "scale", "zero_point"))])  # stash
    return nbytes(layer.svd_up, layer.svd_down) - before


def part1(rounds: int) -> None:
    import loraweave

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(IN, OUT))
    with torch.no_grad():
        base[0].weight.copy_(torch.randn(OUT, IN, generator=g) / IN**0.5)
    lora, lokr = adapters(g, "0", IN)
    x = torch.randn(TOKENS, IN, generator=g)
    rows = []
    for cfg_name, cfg in CONFIGS.items():
        plain = quantize(copy.deepcopy(base), cfg)
        cases = [("factor", lora, dict(mode="auto")), ("runtime", lora, dict(mode="runtime")),
                 ("runtime (lokr)", lokr, dict(mode="runtime")),
                 ("hosted (lokr)", lokr, dict(mode="auto", quantized="host", host_rank=64)),
                 ("requantize", lora, dict(mode="merge", quantized="requantize"))]
        for label, sd, kw in cases:
            model = quantize(copy.deepcopy(base), cfg)
            layer = model[0]
            before = nbytes(getattr(layer, "svd_up", None), getattr(layer, "svd_down", None))
            loraweave.apply(model, sd, strict=True, **kw).remove()  # warm-up: first-use imports and probes
            times = []
            for _ in range(max(3, rounds)):
                t0 = time.perf_counter()
                handle = loraweave.apply(model, sd, strict=True, **kw)
                times.append(time.perf_counter() - t0)
                handle.remove()
            handle = loraweave.apply(model, sd, strict=True, **kw)
            entry = handle.report.applied[0]
            extra = extra_bytes(handle, layer, before)

            def fwd(m):
                def run():
                    with torch.inference_mode():
                        return m(x)
                return run

            res = interleaved([Variant("alone", fwd(plain)), Variant("with", fwd(model))], rounds, log=False)
            rows.append([cfg_name, f"{label} -> {entry.mechanism}", f"{median(times) * 1e3:.1f}",
                         f"{extra / 2**20:.2f}", "-" if entry.retention is None else f"{entry.retention:.4f}",
                         f"{ratio_median(res['with'], res['alone']):.3f}", f"{median(res['alone']) * 1e3:.0f}"])
            handle.remove()
    print(table(["config", "mechanism", "apply ms", "extra MiB", "retention", "step ×", "alone ms"], rows))


def part2(layers: int, dim: int) -> None:
    import loraweave
    from loraweave.mechanisms.factor_cache import FactorCache

    g = torch.Generator().manual_seed(1)
    base = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    with torch.no_grad():
        for m in base:
            m.weight.copy_(torch.randn(dim, dim, generator=g) / dim**0.5)
    model = quantize(base, CONFIGS["uint4"])
    sd = {}
    for i in range(layers):
        sd |= adapters(g, str(i), dim)[1]
    root = tempfile.mkdtemp(prefix="loraweave-factor-cache-")
    try:
        out = {}
        for label in ("fresh", "replay"):
            t0 = time.perf_counter()
            handle = loraweave.apply(model, sd, mode="merge", host_rank=64, cache=FactorCache(root), strict=True)
            dt = time.perf_counter() - t0
            hits = sum(bool(m.cache_hit) for m in handle.report.applied)
            mech = handle.report.mechanisms()["hosted"]
            out[label] = [torch.cat([m.svd_up.flatten(), m.svd_down.flatten()]) for m in model]
            print(f"{label}: {dt:.2f} s for {layers} hosted layers ({dim}x{dim}), cache hits {hits}/{layers}, "
                  f"capture median {mech['capture_median']:.4f} min {mech['capture_min']:.4f}")
            handle.remove()
        same = all(torch.equal(a, b) for a, b in zip(out["fresh"], out["replay"], strict=True))
        size = sum(os.path.getsize(os.path.join(root, f)) for f in os.listdir(root))
        print(f"replay bit-identical to fresh: {same}; cache on disk {size / 2**20:.2f} MiB")
    finally:
        shutil.rmtree(root)


def main() -> None:
    args = parse_args(__doc__, quick=3, full=9, extra=lambda ap: (ap.add_argument("--layers", type=int, default=60),
                                                                   ap.add_argument("--dim", type=int, default=1024)))
    benchutil.setup_torch()
    header("loraweave on SDNQ-quantized layers")
    part1(args.rounds)
    part2(args.layers, args.dim)


if __name__ == "__main__":
    main()
