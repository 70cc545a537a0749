"""Runtime-mode LoRA forward overhead: loraweave's runtime path vs PEFT's unmerged LoraLayer vs the plain
layer.

One Linear(3072, 3072) fp32, input of 4096 tokens x 3072, rank-16 LoRA (alpha 8, scale 0.5). Variants, each on
its own copy of the same weights, timed round-robin (order rotated every round) under inference_mode:

  base      plain nn.Linear
  loraweave loraweave.apply(module, state_dict, mode="runtime")  (low-rank term fused into the Linear's GEMM)
  peft      peft inject_adapter_in_model(LoraConfig(...)), unmerged LoraLayer forward
  merged    loraweave mode="merge" (the same Linear with W + scale*B@A): must cost what base costs
  lora ops  only the two extra GEMMs any post-forward LoRA path needs (h = x@A^T*s; y += h@B^T on a
            preallocated y): the memory-bandwidth floor for the overhead (reads x, reads+writes y once)

Prints median ms, the median of per-round ratios to base, the overhead (ratio - 1) against the FLOP ratio
r*(in+out)/(in*out), output agreement, and (in child processes with glibc's default malloc) the peak RSS
growth of one forward.

    .venv/bin/python benchmarks/bench_runtime.py [--quick] [--rounds N] [--no-mem]
"""

from __future__ import annotations

import copy

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import (
    Variant,
    inference_forward,
    linear_model,
    median,
    reference_cells,
    sandwiched,
    spread,
    table,
)

IN = OUT = 3072
TOKENS = 4096
RANK = 16
ALPHA = 8.0
SCALE = ALPHA / RANK
VARIANTS = ("base", "loraweave", "peft", "merged")


def build(names: tuple[str, ...]) -> tuple[dict[str, torch.nn.Module], torch.Tensor, dict]:
    """Deterministic set-up of the requested variants (each its own copy of the same weights)."""
    g = torch.Generator().manual_seed(0)
    base = linear_model(IN, OUT, g)
    down = torch.randn(RANK, IN, generator=g) / IN**0.5
    up = torch.randn(OUT, RANK, generator=g) / RANK**0.5
    x = torch.randn(1, TOKENS, IN, generator=g)
    sd = {
        "lora_unet_proj.lora_down.weight": down,
        "lora_unet_proj.lora_up.weight": up,
        "lora_unet_proj.alpha": torch.tensor(ALPHA),
    }
    import loraweave

    mods: dict[str, torch.nn.Module] = {}
    keep = []  # handles must outlive the timing
    for name in names:
        if name == "base":
            mods[name] = base
        elif name == "loraweave":
            m = copy.deepcopy(base)
            h = loraweave.apply(m, sd, mode="runtime", strict=True)
            assert h.report.keys_applied == h.report.keys_total == 3, h.report.summary()
            keep.append(h)
            mods[name] = m
        elif name == "merged":
            m = copy.deepcopy(base)
            keep.append(loraweave.apply(m, sd, mode="merge", strict=True))
            mods[name] = m
        elif name == "peft":
            from peft import LoraConfig, inject_adapter_in_model

            m = copy.deepcopy(base)
            cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["proj"], lora_dropout=0.0)
            m = inject_adapter_in_model(cfg, m)
            with torch.no_grad():
                m.proj.lora_A["default"].weight.copy_(down)
                m.proj.lora_B["default"].weight.copy_(up)
            assert m.proj.scaling["default"] == SCALE
            mods[name] = m
    return mods, x, {"handles": keep, "sd": sd}


def main() -> None:
    args = benchutil.parse_args(__doc__, quick=5, full=15, mem=True)
    if args.mem_child:
        benchutil.forward_peak_child(args.mem_child, build)
        return
    rounds = args.rounds
    benchutil.setup_torch()
    benchutil.header("bench_runtime: Linear(3072, 3072) fp32, x (1, 4096, 3072), rank-16 LoRA, runtime mode")

    mods, x, _keep = build(VARIANTS)
    with torch.inference_mode():
        outs = {n: m(x) for n, m in mods.items()}
        ref = outs["merged"]
        scale_y = float(ref.abs().max())
        d_lw_peft = float((outs["loraweave"] - outs["peft"]).abs().max())
        d_lw_merged = float((outs["loraweave"] - ref).abs().max())
        d_peft_merged = float((outs["peft"] - ref).abs().max())
        d_lora = float((outs["loraweave"] - outs["base"]).abs().max())
    del outs, ref

    x2 = x.view(-1, IN)
    down_t = _keep["sd"]["lora_unet_proj.lora_down.weight"].t().contiguous()
    up_t = _keep["sd"]["lora_unet_proj.lora_up.weight"].t().contiguous()
    with torch.inference_mode():
        y_buf = mods["base"](x).view(-1, OUT)

    def lora_ops():
        with torch.inference_mode():
            h = torch.mm(x2, down_t).mul_(SCALE)
            return y_buf.addmm_(h, up_t)

    others = [Variant(n, inference_forward(mods[n], x)) for n in VARIANTS[1:]] + [
        Variant("lora ops", lora_ops)
    ]
    res = sandwiched(Variant("base", inference_forward(mods["base"], x)), others, rounds=rounds, warmup=1)

    flop_ratio = RANK * (IN + OUT) / (IN * OUT)
    rows = [["base", *reference_cells(res, "base"), "-"]]
    ov = {}
    for v in others:
        n = v.name
        r = res.ratio(n)
        r_all = median(res.ratios[n])
        is_ops = n == "lora ops"
        ov[n] = r if is_ops else r - 1
        rows.append(
            [
                "lora ops only" if is_ops else n,
                f"{median(res.times[n]) * 1e3:.1f}",
                f"+-{spread(res.times[n]) * 100:.1f}%",
                "-" if is_ops else f"{r:.4f}",
                f"{r_all:.4f}",
                res.quiet_count(n),
                f"{ov[n] * 100:+.2f}%",
                f"{ov[n] / flop_ratio:.2f}x",
            ]
        )
    floor = ov["lora ops"]
    print()
    print(
        f"rounds={rounds}; every sample divided by the mean of the base runs just before and after it; "
        f"'ratio' = median over quiet samples (those base neighbours within {res.tol * 100:.0f}%), "
        "'ratio all' = median over all samples; 'lora ops only' column 'overhead' = its time / base"
    )
    print(benchutil.noise_line())
    print(
        table(
            [
                "variant",
                "median ms",
                "IQR/2",
                "ratio",
                "ratio all",
                "quiet",
                "overhead",
                "overhead/FLOP ratio",
            ],
            rows,
        )
    )
    print()
    print(f"FLOP ratio r(in+out)/(in*out) = {RANK}*{IN + OUT}/({IN}*{OUT}) = {flop_ratio * 100:.3f}%")
    print(f"bandwidth floor of a post-forward LoRA path (lora ops only): {floor * 100:+.2f}% of base")
    ok_flops = ov["loraweave"] <= 2 * flop_ratio
    ok_peft = ov["loraweave"] < ov["peft"]
    print(
        f"target: loraweave overhead {ov['loraweave'] * 100:+.2f}% <= 2 x FLOP ratio "
        f"({2 * flop_ratio * 100:.2f}%): {'PASS' if ok_flops else 'FAIL'}; below PEFT's "
        f"{ov['peft'] * 100:+.2f}%: {'PASS' if ok_peft else 'FAIL'}  => "
        f"{'HOLDS' if ok_flops and ok_peft else 'DOES NOT HOLD'}"
    )
    print()
    print(f"output agreement (max |y| = {scale_y:.3f}; LoRA changes y by up to {d_lora:.3f}):")
    print(
        table(
            ["pair", "max abs diff"],
            [
                ["loraweave vs peft", f"{d_lw_peft:.3e}"],
                ["loraweave vs merged", f"{d_lw_merged:.3e}"],
                ["peft vs merged", f"{d_peft_merged:.3e}"],
            ],
        )
    )
    if not args.no_mem:
        print()
        mem = {n: rec["peak_mib"] for n, rec in benchutil.mem_children(__file__, VARIANTS).items()}
        out_mib = TOKENS * OUT * 4 / 2**20
        print("peak RSS growth of one steady-state forward (child process per variant, default glibc malloc;")
        print(f"the output tensor alone is {out_mib:.0f} MiB):")
        print(
            table(
                ["variant", "peak delta MiB", "vs base"],
                [
                    [n, f"{mem[n]:.1f}", f"{mem[n] / mem['base']:.2f}x" if mem["base"] else "-"]
                    for n in VARIANTS
                ],
            )
        )


if __name__ == "__main__":
    main()
