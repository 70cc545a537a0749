"""Runtime-mode LoKr forward: loraweave's Kronecker-structured path vs a materialised dense ΔW vs the plain
layer.

One Linear(3072, 3072) fp32, input of 4096 tokens x 3072. Two realistic LyCORIS LoKr shapes (factorization of
3072 as LyCORIS computes it):

  f-1 r16    LyCORIS default factor=-1 -> (48, 64): w1 (48, 48) full, w2 = w2_a (64, 16) @ w2_b (16, 64),
             alpha 8 (scale 0.5)
  f16 full   factor=16 with a dim too large to decompose (full matrix) -> w1 (16, 16), w2 (192, 192), scale 1

Variants, each on its own copy of the same weights, timed round-robin (order rotated every round) under
inference_mode, every sample divided by the mean of the base runs either side (benchutil.sandwiched):

  base             plain nn.Linear
  lokr f-1 r16     loraweave.apply(module, state_dict, mode="runtime"): y += γ·vec(w1·X·w2ᵀ), no kron
  lokr f16 full    the same for the second shape
  dense ΔW         the same LoKr (f-1 r16) with ΔW = γ·kron(w1, w2) built once and cached: y += x·ΔWᵀ
  lycoris bypass   LyCORIS 4.x LokrModule(bypass_mode=True) on f-1 r16: its own structured path

Prints median ms, ratio to base, extra MACs per token, output agreement, and (in child processes with glibc's
default malloc) the peak RSS growth of one steady-state forward plus the persistent memory each form keeps.

    .venv/bin/python benchmarks/bench_lokr.py [--quick] [--rounds N] [--no-mem]
"""

from __future__ import annotations

import copy

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
import torch.nn.functional as F
from benchutil import (
    Variant,
    inference_forward,
    linear_model,
    reference_cells,
    sandwiched,
    table,
    variant_cells,
)

IN = OUT = 3072
TOKENS = 4096
VARIANTS = ("base", "lokr f-1 r16", "lokr f16 full", "dense ΔW", "lycoris bypass")
STEM = "lora_unet_proj"


class DenseDelta(torch.nn.Module):
    """The materialised alternative: the Linear plus one dense extra GEMM with a cached ΔW."""

    def __init__(self, lin: torch.nn.Linear, delta: torch.Tensor) -> None:
        super().__init__()
        self.proj, self.delta = lin, delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y.add_(F.linear(x, self.delta))


def adapters(g: torch.Generator) -> dict[str, tuple[dict[str, torch.Tensor], float]]:
    """{name: (state dict, γ)}; factor scales keep ΔW's entries near the weight's (1/sqrt(in))."""
    a = {
        f"{STEM}.lokr_w1": torch.randn(48, 48, generator=g) / 48**0.5,
        f"{STEM}.lokr_w2_a": torch.randn(64, 16, generator=g) / 16**0.5,
        f"{STEM}.lokr_w2_b": torch.randn(16, 64, generator=g) / 64**0.5,
        f"{STEM}.alpha": torch.tensor(8.0),
    }
    b = {
        f"{STEM}.lokr_w1": torch.randn(16, 16, generator=g) / 16**0.5,
        f"{STEM}.lokr_w2": torch.randn(192, 192, generator=g) / 192**0.5,
    }
    return {"lokr f-1 r16": (a, 0.5), "lokr f16 full": (b, 1.0)}


def dense_delta(sd: dict[str, torch.Tensor], gamma: float) -> torch.Tensor:
    w1 = sd[f"{STEM}.lokr_w1"]
    w2 = sd.get(f"{STEM}.lokr_w2")
    w2 = w2 if w2 is not None else sd[f"{STEM}.lokr_w2_a"] @ sd[f"{STEM}.lokr_w2_b"]
    return torch.kron(w1, w2) * gamma


def build(names: tuple[str, ...]) -> tuple[dict[str, torch.nn.Module], torch.Tensor, dict]:
    """Deterministic set-up of the requested variants (each its own copy of the same weights)."""
    g = torch.Generator().manual_seed(0)
    base = linear_model(IN, OUT, g)
    ads = adapters(g)
    x = torch.randn(1, TOKENS, IN, generator=g)
    import loraweave

    mods: dict[str, torch.nn.Module] = {}
    keep: list = []  # handles must outlive the timing
    for name in names:
        if name == "base":
            mods[name] = base
        elif name in ads:
            m = copy.deepcopy(base)
            h = loraweave.apply(m, ads[name][0], mode="runtime", strict=True)
            assert h.report.keys_applied == h.report.keys_total == len(ads[name][0]), h.report.summary()
            keep.append(h)
            mods[name] = m
        elif name == "dense ΔW":
            mods[name] = DenseDelta(copy.deepcopy(base.proj), dense_delta(*ads["lokr f-1 r16"]))
        elif name == "lycoris bypass":
            from lycoris.modules.lokr import LokrModule

            m = copy.deepcopy(base)
            sd = ads["lokr f-1 r16"][0]
            lyco = LokrModule(
                "lycoris_proj", m.proj, multiplier=1.0, lora_dim=16, alpha=8.0, bypass_mode=True
            )
            assert lyco.use_w1 and not lyco.use_w2 and lyco.scale == 0.5
            with torch.no_grad():
                for role in ("lokr_w1", "lokr_w2_a", "lokr_w2_b"):
                    getattr(lyco, role).copy_(sd[f"{STEM}.{role}"])
            lyco.apply_to()
            keep.append(lyco)
            mods[name] = m
    return mods, x, {"handles": keep, "adapters": ads}


def extra_macs(sd: dict[str, torch.Tensor]) -> int:
    """Per-token MACs of the structured path as loraweave runs it (w2 first, w2 kept dense below 4x
    savings)."""
    a, c = sd[f"{STEM}.lokr_w1"].shape
    w2 = sd.get(f"{STEM}.lokr_w2")
    b, n = (
        w2.shape if w2 is not None else (sd[f"{STEM}.lokr_w2_a"].shape[0], sd[f"{STEM}.lokr_w2_b"].shape[1])
    )
    return c * b * n + a * c * b


def main() -> None:
    args = benchutil.parse_args(__doc__, quick=3, full=7, mem=True)
    if args.mem_child:
        benchutil.forward_peak_child(args.mem_child, build)
        return
    rounds = args.rounds
    benchutil.setup_torch()
    benchutil.header("bench_lokr: Linear(3072, 3072) fp32, x (1, 4096, 3072), LoKr runtime mode")

    mods, x, keep = build(VARIANTS)
    ads = keep["adapters"]
    with torch.inference_mode():
        outs = {n: m(x) for n, m in mods.items()}
        refs = {
            n: F.linear(x, mods["base"].proj.weight + dense_delta(*ads[n]), mods["base"].proj.bias)
            for n in ads
        }
    agree = [
        ["lokr f-1 r16 vs W+ΔW", f"{float((outs['lokr f-1 r16'] - refs['lokr f-1 r16']).abs().max()):.3e}"],
        [
            "lokr f16 full vs W+ΔW",
            f"{float((outs['lokr f16 full'] - refs['lokr f16 full']).abs().max()):.3e}",
        ],
        ["dense ΔW vs W+ΔW (f-1 r16)", f"{float((outs['dense ΔW'] - refs['lokr f-1 r16']).abs().max()):.3e}"],
        [
            "lycoris bypass vs W+ΔW (f-1 r16)",
            f"{float((outs['lycoris bypass'] - refs['lokr f-1 r16']).abs().max()):.3e}",
        ],
    ]
    scale_y = float(refs["lokr f-1 r16"].abs().max())
    d_lokr = float((refs["lokr f-1 r16"] - outs["base"]).abs().max())
    del outs, refs

    others = [Variant(n, inference_forward(mods[n], x)) for n in VARIANTS[1:]]
    res = sandwiched(Variant("base", inference_forward(mods["base"], x)), others, rounds=rounds, warmup=1)

    macs = {"base": 0, "dense ΔW": IN * OUT, "lycoris bypass": extra_macs(ads["lokr f-1 r16"][0])}
    macs.update({n: extra_macs(sd) for n, (sd, _) in ads.items()})
    rows = [["base", *reference_cells(res, "base"), "0"]]
    rows += [[v.name, *variant_cells(res, v.name), str(macs[v.name])] for v in others]
    print()
    benchutil.print_legend(rounds, res)
    print(
        table(
            ["variant", "median ms", "IQR/2", "ratio", "ratio all", "quiet", "overhead", "extra MACs/token"],
            rows,
        )
    )
    print(f"(base GEMM: {IN * OUT} MACs/token)")
    print()
    print(f"output agreement (max |y| = {scale_y:.3f}; the LoKr changes y by up to {d_lokr:.3f}):")
    print(table(["pair", "max abs diff"], agree))
    if not args.no_mem:
        print()
        mem = {n: rec["peak_mib"] for n, rec in benchutil.mem_children(__file__, VARIANTS).items()}
        dense_mib = IN * OUT * 4 / 2**20
        kept = {"base": 0.0, "dense ΔW": dense_mib}
        for n, (sd, _) in ads.items():  # what the runtime path caches: fp32 w1 and w2 (+ w2 factors if kept)
            w2 = sd.get(f"{STEM}.lokr_w2")
            w2n = w2.numel() if w2 is not None else 64 * 64
            kept[n] = (sd[f"{STEM}.lokr_w1"].numel() + w2n) * 4 / 2**20
        kept["lycoris bypass"] = (
            sum(t.numel() for k, t in ads["lokr f-1 r16"][0].items() if "lokr" in k) * 4 / 2**20
        )
        print(
            f"memory: peak RSS growth of one steady-state forward (child process per variant, default glibc "
            f"malloc; the output tensor alone is {TOKENS * OUT * 4 / 2**20:.0f} MiB), and what the form keeps"
        )
        print(
            table(
                ["variant", "peak delta MiB", "vs base", "kept MiB"],
                [
                    [
                        n,
                        f"{mem[n]:.1f}",
                        f"{mem[n] / mem['base']:.2f}x" if mem["base"] else "-",
                        f"{kept[n]:.3f}",
                    ]
                    for n in VARIANTS
                ],
            )
        )


if __name__ == "__main__":
    main()
