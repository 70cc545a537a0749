"""The FLOP floor on a plain nn.Linear: is x·Aᵀ cheaper inside the base GEMM, with W stored as a view into [W; A]?

One Linear(3072, 3072) fp32, x of 4096 tokens, rank-16 LoRA (scale 0.5). Variants, each on its own copy of the
same weights, timed sandwiched between base runs (benchutil.sandwiched; medians of per-sample ratios):

  base       plain nn.Linear
  loraweave  today's runtime path: h = x·Aᵀ·s, y = b + h·Bᵀ, y += x·Wᵀ (the low-rank term in the GEMM accumulator)
  stacked    the prototype: S = [W; A] (out + r rows; W is the view S[:out], so memory stays W + A); one GEMM
             z = x·Sᵀ (tokens x (out + r)), then y = z[:, :out] + b, y += (s·z[:, out:])·Bᵀ: one skinny GEMM left.
             y is a strided view of z (row stride out + r); the copy that makes it contiguous is timed too
             ("stacked+contig"), since most next layers need a contiguous input
  peft       PEFT's unmerged LoraLayer
  lora ops   only the two skinny GEMMs (h = x·Aᵀ·s; y += h·Bᵀ into a preallocated y): the floor of any
             post-forward path

    .venv/bin/python benchmarks/bench_floor.py [--quick] [--rounds N]
"""

from __future__ import annotations

import copy

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, inference_forward, linear_lora, median, sandwiched, spread, table

IN = OUT = 3072
TOKENS = 4096
RANK = 16
SCALE = 0.5


def _stacked(lin: torch.nn.Linear, down: torch.Tensor, up: torch.Tensor, contiguous: bool):
    """The [W; A] prototype as a forward function (the same arithmetic a library path would run)."""
    stack = torch.cat([lin.weight.detach(), down])  # W would then be re-pointed at stack[:OUT]: no extra memory
    bias, up_t = lin.bias.detach(), up.t().contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            x2 = x.view(-1, IN)
            z = torch.mm(x2, stack.t())
            y, h = z[:, :OUT], z[:, OUT:].mul_(SCALE)
            y.add_(bias).addmm_(h, up_t)
            return y.contiguous() if contiguous else y

    return run


def main() -> None:
    args = benchutil.parse_args(__doc__, quick=5, full=11)
    benchutil.setup_torch()
    benchutil.header("bench_floor: Linear(3072, 3072) fp32, x (1, 4096, 3072), rank-16 LoRA")
    from peft import LoraConfig, inject_adapter_in_model

    import loraweave

    base, sd, x = linear_lora(IN, OUT, TOKENS, RANK, alpha=SCALE * RANK)
    down, up = sd["lora_unet_proj.lora_down.weight"], sd["lora_unet_proj.lora_up.weight"]
    lw = copy.deepcopy(base)
    keep = loraweave.apply(lw, sd, mode="runtime", strict=True)
    peft = inject_adapter_in_model(LoraConfig(r=RANK, lora_alpha=SCALE * RANK, target_modules=["proj"]),
                                   copy.deepcopy(base))
    with torch.no_grad():
        peft.proj.lora_A["default"].weight.copy_(down)
        peft.proj.lora_B["default"].weight.copy_(up)
    stacked, stacked_c = _stacked(base.proj, down, up, False), _stacked(base.proj, down, up, True)

    with torch.inference_mode():
        ref = lw(x).view(-1, OUT)
        agree = {"stacked vs loraweave": float((stacked(x) - ref).abs().max()),
                 "peft vs loraweave": float((peft(x).view(-1, OUT) - ref).abs().max())}
        x2, down_t, up_t = x.view(-1, IN), down.t().contiguous(), up.t().contiguous()
        y_buf = base(x).view(-1, OUT)

    def lora_ops():
        with torch.inference_mode():
            return y_buf.addmm_(torch.mm(x2, down_t).mul_(SCALE), up_t)

    others = [Variant("loraweave", inference_forward(lw, x)), Variant("stacked", lambda: stacked(x)),
              Variant("stacked+contig", lambda: stacked_c(x)), Variant("peft", inference_forward(peft, x)),
              Variant("lora ops", lora_ops)]
    res = sandwiched(Variant("base", inference_forward(base, x)), others, rounds=args.rounds, warmup=1)
    floor = RANK * (IN + OUT) / (IN * OUT)
    rows = []
    for v in others:
        r = res.ratio(v.name)
        over = r if v.name == "lora ops" else r - 1
        rows.append([v.name, f"{median(res.times[v.name]) * 1e3:.1f}", f"+-{spread(res.times[v.name]) * 100:.1f}%",
                     res.quiet_count(v.name), f"{over * 100:+.2f}%", f"{over / floor:.2f}x"])
    print(f"rounds={args.rounds}; base median {median(res.times['base']) * 1e3:.1f} ms; {benchutil.noise_line()}")
    print(table(["variant", "median ms", "IQR/2", "quiet", "overhead vs base", "x FLOP floor"], rows))
    print(f"FLOP floor r(in+out)/(in*out) = {floor * 100:.3f}%; target <= 2x ({2 * floor * 100:.2f}%)")
    print("output agreement (max abs diff): " + ", ".join(f"{k} {v:.2e}" for k, v in agree.items()))
    del keep


if __name__ == "__main__":
    main()
