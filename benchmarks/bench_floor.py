"""The FLOP floor on a plain nn.Linear: how close does a runtime LoRA get to r(in+out)/(in*out) of the base
cost?

One Linear(3072, 3072) fp32, x of 4096 tokens, rank-16 LoRA (scale 0.5); floor 1.04%, target <= 2x (2.08%).
Two measurements in one run:

1. End to end: every formulation below, each sandwiched between base runs (benchutil.sandwiched; medians of
   per-sample ratios). Default clock: CPU seconds of this process with ONE torch thread (time.process_time),
   which a descheduled process does not accrue: on the shared 2-core host wall time with 2 threads swings by
   5-30% and cannot resolve a 2% target. `--threads 2 --clock wall` gives the old-style measurement.

   loraweave       the library's runtime path: h = x·Aᵀ·s, y = b + h·Bᵀ, y += x·Wᵀ (low-rank term in the GEMM
                   accumulator), the two thin GEMMs on oneDNN (mechanisms/runtime/skinny.py)
   mkl (before)    the same formula, every GEMM on MKL's sgemm (torch.mm/addmm): the path before skinny.py
   base-first      y = b + x·Wᵀ, then y += h·Bᵀ in place (no second output-sized temporary); MKL
   contig A^T B^T  the MKL formula with Aᵀ and Bᵀ stored contiguous (the layouts the skinny kernels read)
   out= buffers    the MKL formula writing into preallocated h and y (no allocation, no page faults)
   r padded 32     the MKL formula with the rank zero-padded to 32 (wider skinny GEMMs)
   stacked         S = [W; A] (W would be the view S[:out]: memory unchanged); z = [b, 0] + x·Sᵀ in ONE GEMM,
                   y = z[:, :out] += (s·z[:, out:])·Bᵀ: the down GEMM rides in the base GEMM; y is a strided
                   view
   stacked+contig  the same, the up GEMM writing a fresh contiguous y (what a next layer needs)
   fold            ΔW folded into W on every forward: W_eff = W + B·(s·A) into a reused buffer, then one GEMM
   peft            PEFT's unmerged LoraLayer
   lora ops        the two bare skinny GEMMs only (into a preallocated y): the floor of any post-forward path
   lora ops onednn the same two GEMMs on the kernels the library uses (mechanisms/runtime/skinny.py), into a
   fresh y

2. Components: the small kernels those paths are made of, timed many times each (interleaved) against the base
   GEMM's median. The fused path costs over the base GEMM: down + scale + up(with bias) + what the base GEMM
   costs more when it accumulates into that y than with its own bias (both timed, and the base GEMM without a
   bias beside them, rather than a stand-in broadcast kernel); the table shows each kernel's share next to its
   FLOP share, i.e. how far below the base GEMM's efficiency it runs (MKL's sgemm vs oneDNN for the same
   product).

3. `--base-kernel onednn`: the same question against a FASTER base GEMM. The ratio to the floor depends on how
   fast the base GEMM runs next to the memory-bound thin GEMMs: torch's fp32 Linear is MKL's sgemm, which on
   AMD CPUs runs well below oneDNN's matmul (90 vs 199 GF/s on the session-7 EPYC host). Here the base forward
   is oneDNN's linear and the formulations use it for their base GEMM (the low-rank term added by its binary
   post-op), so the ratios show what a host with a fast sgemm would see. The library does not run this form
   (nn.Linear's own kernel stays the base GEMM); no PEFT row and no components table in this mode.

    .venv/bin/python benchmarks/bench_floor.py [--quick] [--rounds N] [--threads 1] [--clock cpu|wall]
        [--only "loraweave,peft,lora ops"] [--no-components] [--base-kernel torch|onednn]
        (fewer variants: more rounds in the same time)
"""

from __future__ import annotations

import copy
import statistics

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import Variant, inference_forward, linear_lora, median, sandwiched, spread, table

from loraweave.mechanisms.runtime.skinny import skinny_linear

IN = OUT = 3072
TOKENS = 4096
RANK = 16
SCALE = 0.5
FLOOR = RANK * (IN + OUT) / (IN * OUT)
COMPONENT_REPS = 31


class Factors:
    """The dense tensors of the one Linear and its LoRA, in every layout the formulations want."""

    def __init__(self, lin: torch.nn.Linear, down: torch.Tensor, up: torch.Tensor, x: torch.Tensor) -> None:
        self.w, self.b = lin.weight.detach(), lin.bias.detach()
        self.down, self.up, self.s = down, up, torch.full((RANK,), SCALE)
        self.x2 = x.view(-1, IN)
        self.down_t, self.up_t = down.t().contiguous(), up.t().contiguous()
        pad = 32 - RANK
        self.down32 = torch.cat([down, down.new_zeros(pad, IN)])
        self.up32 = torch.cat([up, up.new_zeros(OUT, pad)], dim=1)
        self.s32 = torch.cat([self.s, self.s.new_zeros(pad)])
        self.stack = torch.cat([self.w, down])  # a library would re-point W at stack[:OUT]
        self.bias0 = torch.cat([self.b, self.b.new_zeros(RANK)])
        self.h_buf, self.y_buf = torch.empty(TOKENS, RANK), torch.empty(TOKENS, OUT)
        self.w_buf = torch.empty_like(self.w)


def formulations(f: Factors) -> dict:
    """name -> forward on the (tokens, in) input, each under inference_mode (same arithmetic a library would
    run)."""
    x, w = f.x2, f.w

    def mkl():
        h = torch.mm(x, f.down.t()).mul_(f.s)
        return torch.addmm(f.b, h, f.up.t()).addmm_(x, w.t())

    def base_first():
        y = torch.addmm(f.b, x, w.t())
        return y.addmm_(torch.mm(x, f.down.t()).mul_(f.s), f.up.t())

    def contig():
        h = torch.mm(x, f.down_t).mul_(f.s)
        return torch.addmm(f.b, h, f.up_t).addmm_(x, w.t())

    def out_buffers():
        torch.mm(x, f.down.t(), out=f.h_buf).mul_(f.s)
        return torch.addmm(f.b, f.h_buf, f.up.t(), out=f.y_buf).addmm_(x, w.t())

    def padded():
        h = torch.mm(x, f.down32.t()).mul_(f.s32)
        return torch.addmm(f.b, h, f.up32.t()).addmm_(x, w.t())

    def stacked():
        z = torch.addmm(f.bias0, x, f.stack.t())
        return z[:, :OUT].addmm_(z[:, OUT:].mul_(f.s), f.up.t())

    def stacked_contig():
        z = torch.addmm(f.bias0, x, f.stack.t())
        return torch.addmm(z[:, :OUT], z[:, OUT:].mul_(f.s), f.up.t())

    def fold():
        w_eff = torch.addmm(w, f.up * f.s, f.down, out=f.w_buf)  # into a reused buffer: no page faults
        return torch.addmm(f.b, x, w_eff.t())

    return {
        "mkl (before)": mkl,
        "base-first": base_first,
        "contig A^T B^T": contig,
        "out= buffers": out_buffers,
        "r padded 32": padded,
        "stacked": stacked,
        "stacked+contig": stacked_contig,
        "fold": fold,
    }


def _onednn_linear():
    """oneDNN's linear op (what skinny.py probes), or exit with the reason when this torch build lacks it."""
    op = (
        getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    )
    if op is None:
        raise SystemExit("--base-kernel onednn: this torch build has no oneDNN linear (torch.ops.mkldnn)")
    return op


def onednn_formulations(f: Factors, op) -> dict:
    """--base-kernel onednn: name -> forward whose base GEMM is oneDNN's linear (op), like the base it is
    timed against; `loraweave formula` is the library's arithmetic with that base GEMM, the low-rank term
    entering as the GEMM's binary-add post-op (oneDNN's form of an accumulator)."""
    x, w = f.x2, f.w

    def formula():
        y = skinny_linear(skinny_linear(x, f.down).mul_(f.s), f.up, f.b)
        return op.binary(x, y, w, None, "add")

    def stacked():
        z = op(x, f.stack, f.bias0, "none", [], "")
        return z[:, :OUT].addmm_(z[:, OUT:].mul_(f.s), f.up.t())

    return {"loraweave formula": formula, "stacked": stacked}


def _inference(fn):
    def run():
        with torch.inference_mode():
            return fn()

    return run


def components(f: Factors, base, clock) -> list[list[str]]:
    """Each small kernel's median share of the base forward, timed interleaved COMPONENT_REPS times."""
    x, h = f.x2, torch.mm(f.x2, f.down.t())
    kernels = {
        "base GEMM with its bias: addmm(b, x, Wᵀ)": (lambda: torch.addmm(f.b, x, f.w.t()), 1.0),
        "base GEMM into y: y.addmm_(x, Wᵀ)": (lambda: f.y_buf.addmm_(x, f.w.t()), 1.0),
        "base GEMM without bias: mm(x, Wᵀ)": (lambda: torch.mm(x, f.w.t()), 1.0),
        "down: x·Aᵀ, MKL": (lambda: torch.mm(x, f.down.t()), RANK * IN / (IN * OUT)),
        "down, Aᵀ contiguous, MKL": (lambda: torch.mm(x, f.down_t), RANK * IN / (IN * OUT)),
        "down: x·Aᵀ, oneDNN": (lambda: skinny_linear(x, f.down), RANK * IN / (IN * OUT)),
        "scale h by s": (lambda: h.mul_(f.s), 0.0),
        "up: b + h·Bᵀ (new y), MKL": (lambda: torch.addmm(f.b, h, f.up.t()), RANK * OUT / (IN * OUT)),
        "up: b + h·Bᵀ (new y), oneDNN": (lambda: skinny_linear(h, f.up, f.b), RANK * OUT / (IN * OUT)),
        "up: y += h·Bᵀ in place, MKL": (lambda: f.y_buf.addmm_(h, f.up.t()), RANK * OUT / (IN * OUT)),
        "one pass over y (copy)": (lambda: f.y_buf.copy_(x), 0.0),
    }
    times = {n: [] for n in kernels}
    base_times = []
    names = list(kernels)
    with torch.inference_mode():
        for r in range(-1, COMPONENT_REPS):
            if r % 6 == 0 or r == -1:
                t0 = clock()
                base()
                if r >= 0:
                    base_times.append(clock() - t0)
            for n in names[r % len(names) :] + names[: r % len(names)]:
                t0 = clock()
                kernels[n][0]()
                if r >= 0:
                    times[n].append(clock() - t0)
    mb = statistics.median(base_times)
    share = {n: statistics.median(v) / mb for n, v in times.items()}
    rows = [
        [
            n,
            f"{statistics.median(times[n]) * 1e3:.2f}",
            f"{share[n] * 100:.2f}%",
            f"{flops * 100:.2f}%" if flops else "-",
            f"{share[n] / flops:.1f}x" if flops else "-",
        ]
        for n, (_, flops) in kernels.items()
    ]
    # what the base GEMM costs more (or less) when it accumulates into the y the up GEMM wrote than with its
    # bias (negative: accumulating skips the bias the base GEMM applies, which the up GEMM's output already
    # holds)
    accumulate = (
        share["base GEMM into y: y.addmm_(x, Wᵀ)"] - share["base GEMM with its bias: addmm(b, x, Wᵀ)"]
    )
    scale = share["scale h by s"]
    sums = {
        "=> loraweave: down + scale + up(b) + (accumulate - bias), oneDNN": share["down: x·Aᵀ, oneDNN"]
        + scale
        + share["up: b + h·Bᵀ (new y), oneDNN"]
        + accumulate,
        "=> before: the same on MKL": share["down: x·Aᵀ, MKL"]
        + scale
        + share["up: b + h·Bᵀ (new y), MKL"]
        + accumulate,
        "=> bare skinny GEMMs on MKL: down + scale + up in place": share["down: x·Aᵀ, MKL"]
        + scale
        + share["up: y += h·Bᵀ in place, MKL"],
    }
    rows += [[n, "", f"{v * 100:.2f}%", f"{FLOOR * 100:.2f}%", f"{v / FLOOR:.2f}x"] for n, v in sums.items()]
    print(
        f"components: base forward median {mb * 1e3:.1f} ms over {len(base_times)} samples; "
        f"{COMPONENT_REPS} samples per kernel"
    )
    return rows


def main() -> None:
    def extra(ap):
        benchutil.add_clock_args(ap)
        ap.add_argument(
            "--only",
            default="",
            help="comma-separated variants to time end to end (default: all); "
            "e.g. 'loraweave,peft,lora ops' for more rounds in the same time",
        )
        ap.add_argument("--no-components", action="store_true", help="skip the per-kernel table")
        ap.add_argument(
            "--base-kernel",
            choices=("torch", "onednn"),
            default="torch",
            help="the base GEMM: torch's nn.Linear (default; MKL sgemm) or oneDNN's linear (a fast-GEMM "
            "host's view, see 3. in the docstring)",
        )

    args = benchutil.parse_args(__doc__, quick=5, full=11, extra=extra)
    benchutil.setup_torch()
    clock = benchutil.use_clock_args(args)
    benchutil.header(
        f"bench_floor: Linear(3072, 3072) fp32, x (1, 4096, 3072), rank-16 LoRA; clock={args.clock}"
    )
    from peft import LoraConfig, inject_adapter_in_model

    import loraweave

    base, sd, x = linear_lora(IN, OUT, TOKENS, RANK, alpha=SCALE * RANK)
    down, up = sd["lora_unet_proj.lora_down.weight"], sd["lora_unet_proj.lora_up.weight"]
    lw = copy.deepcopy(base)
    keep = loraweave.apply(lw, sd, mode="runtime", strict=True)
    peft = inject_adapter_in_model(
        LoraConfig(r=RANK, lora_alpha=SCALE * RANK, target_modules=["proj"]), copy.deepcopy(base)
    )
    with torch.no_grad():
        peft.proj.lora_A["default"].weight.copy_(down)
        peft.proj.lora_B["default"].weight.copy_(up)
    f = Factors(base.proj, down, up, x)
    onednn = args.base_kernel == "onednn"
    op = _onednn_linear() if onednn else None
    forms = {
        name: _inference(fn)
        for name, fn in (onednn_formulations(f, op) if onednn else formulations(f)).items()
    }

    def lora_ops():
        with torch.inference_mode():
            return f.y_buf.addmm_(torch.mm(f.x2, f.down.t()).mul_(f.s), f.up.t())

    def lora_ops_onednn():
        with torch.inference_mode():
            return skinny_linear(skinny_linear(f.x2, f.down).mul_(f.s), f.up)

    with torch.inference_mode():
        ref = lw(x).view(-1, OUT)
        scale = float(ref.abs().max())
        agree = {name: float((fn() - ref).abs().max()) / scale for name, fn in forms.items()}
        if not onednn:
            agree["peft"] = float((peft(x).view(-1, OUT) - ref).abs().max()) / scale
        f.y_buf.copy_(base(x).view(-1, OUT))

    library = [] if onednn else [Variant("loraweave", inference_forward(lw, x))]
    others = [
        *library,
        *(Variant(n, fn) for n, fn in forms.items()),
        *([] if onednn else [Variant("peft", inference_forward(peft, x))]),
        Variant("lora ops", lora_ops),
        Variant("lora ops onednn", lora_ops_onednn),
    ]
    only = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(only) - {v.name for v in others})
    if unknown:
        raise SystemExit(f"--only: no variant {', '.join(unknown)}; have {', '.join(v.name for v in others)}")
    others = [v for v in others if not only or v.name in only]
    base_run = (
        _inference(lambda: op(f.x2, f.w, f.b, "none", [], "")) if onednn else inference_forward(base, x)
    )
    res = sandwiched(Variant("base", base_run), others, rounds=args.rounds, warmup=1, clock=clock)
    rows = []
    for v in others:
        r = res.ratio(v.name)
        bare = v.name.startswith("lora ops")  # timed alone: its ratio to the base is its overhead
        over = r if bare else r - 1
        lo, hi = (b - (0 if bare else 1) for b in res.interval(v.name))
        rows.append(
            [
                v.name,
                f"{median(res.times[v.name]) * 1e3:.1f}",
                f"+-{spread(res.times[v.name]) * 100:.1f}%",
                res.quiet_count(v.name),
                f"{over * 100:+.2f}%",
                f"{lo * 100:+.2f}% .. {hi * 100:+.2f}%",
                f"{over / FLOOR:.2f}x",
            ]
        )
    base_ms = median(res.times["base"]) * 1e3
    print(
        f"rounds={args.rounds}; base ({'oneDNN linear' if onednn else 'nn.Linear'}) median {base_ms:.1f} ms "
        f"= {2 * TOKENS * IN * OUT / base_ms / 1e6:.0f} GF/s; {benchutil.noise_line()}"
    )
    print(
        table(
            ["variant", "median ms", "IQR/2", "quiet", "overhead vs base", "90% interval", "x FLOP floor"],
            rows,
        )
    )
    print(f"FLOP floor r(in+out)/(in*out) = {FLOOR * 100:.3f}%; target <= 2x ({2 * FLOOR * 100:.2f}%)")
    print(
        "output agreement vs loraweave (max abs diff / max |y|): "
        + ", ".join(f"{k} {v:.1e}" for k, v in agree.items())
    )
    if not args.no_components and not onednn:
        print(
            table(
                ["kernel", "median ms", "share of base", "FLOP share", "x its FLOP share"],
                components(f, base_run, clock),
            )
        )
    del keep


if __name__ == "__main__":
    main()
