"""Per-sample adapters in one forward (Handle.batch) and regional masks (Handle.set_region), against their
baselines.

A stack of Linear(3072, 3072) fp32 (`--layers`, default 1), x (8, 4096, 3072): 8 samples of 4,096 tokens, 8
different rank-16 LoRAs (one per sample). Variants, timed round-robin under inference_mode:

  shared      (c) the same batch with one shared adapter at runtime: the reference
  ours        (a) loraweave, 8 adapters at runtime, inside `handle.batch([[a0], ..., [a7]])`: one forward
  exact       the same with `handle.batch(..., exact=True)`: each set over all rows as its lone apply
              (serving)
  sequential  (b) 8 forwards of one sample each, each on its own copy with its adapter at runtime
  concat      hand-written alternative: one rank-128 pair over all rows, h gated per row (x·Dcatᵀ ⊙
              G[row])·Ucatᵀ
  bmm         hand-written alternative: per-sample factors gathered (8, in, 16), two bmm (S-LoRA/Punica BGMV
              form)

Then the regional overhead: x (1, 4096, 3072) read as a 64×64 token grid, one adapter at runtime, plain vs
with a half mask (`set_region`). Each variant is timed between two runs of the reference
(benchutil.sandwiched): the ratio is the median over samples whose two reference neighbours agree (a quiet
host). Outputs are checked against the sequential runs first.

    .venv/bin/python benchmarks/bench_persample.py [--quick] [--rounds N] [--layers N] [--tokens N]
"""

from __future__ import annotations

import copy

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
import torch.nn.functional as F
from benchutil import Variant, inference_forward, reference_cells, sandwiched, table, variant_cells

DIM, RANK, SAMPLES = 3072, 16, 8


class Stack(torch.nn.Module):
    def __init__(self, layers: int, g: torch.Generator) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(DIM, DIM) for _ in range(layers))
        with torch.no_grad():
            for lin in self.blocks:
                lin.weight.copy_(torch.randn(DIM, DIM, generator=g) / DIM**0.5)
                lin.bias.copy_(torch.randn(DIM, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.blocks:
            x = lin(x)
        return x


def lora(layers: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    sd = {}
    for i in range(layers):
        sd[f"blocks.{i}.lora_down.weight"] = torch.randn(RANK, DIM, generator=g) / DIM**0.5
        sd[f"blocks.{i}.lora_up.weight"] = torch.randn(DIM, RANK, generator=g) / RANK**0.5
        sd[f"blocks.{i}.alpha"] = torch.tensor(float(RANK))
    return sd


def hand_concat(model: Stack, sds: list[dict], layers: int):
    """One rank-(8·16) pair; each row keeps its sample's 16 ranks through a 0/1 gate."""
    downs = [torch.cat([sd[f"blocks.{i}.lora_down.weight"] for sd in sds]) for i in range(layers)]
    ups = [
        torch.cat([sd[f"blocks.{i}.lora_up.weight"] for sd in sds], dim=1).t().contiguous()
        for i in range(layers)
    ]
    gate = torch.block_diag(*[torch.ones(1, RANK)] * SAMPLES)  # (8, 128)

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            for lin, d, u in zip(model.blocks, downs, ups, strict=True):
                y = F.linear(x, lin.weight, lin.bias)
                h = F.linear(x, d).mul_(gate[:, None, :])
                y.view(-1, DIM).addmm_(h.view(-1, h.shape[-1]), u)
                x = y
            return x

    return run


def hand_bmm(model: Stack, sds: list[dict], layers: int):
    """Per-sample factors stacked (B, in, r) / (B, r, out): h = bmm(x, D), y += bmm(h, U)."""
    downs = [torch.stack([sd[f"blocks.{i}.lora_down.weight"].t() for sd in sds]) for i in range(layers)]
    ups = [torch.stack([sd[f"blocks.{i}.lora_up.weight"].t() for sd in sds]) for i in range(layers)]

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            for lin, d, u in zip(model.blocks, downs, ups, strict=True):
                y = F.linear(x, lin.weight, lin.bias)
                x = y.baddbmm_(torch.bmm(x, d), u)
            return x

    return run


def batch_variants(layers: int, tokens: int):
    import loraweave

    g = torch.Generator().manual_seed(0)
    base = Stack(layers, g)
    sds = [lora(layers, g) for _ in range(SAMPLES)]
    x = torch.randn(SAMPLES, tokens, DIM, generator=g)
    names = [f"a{i}" for i in range(SAMPLES)]
    keep = []

    shared = copy.deepcopy(base)
    keep.append(
        loraweave.apply(shared, loraweave.AdapterSpec(sds[0], name="a0"), mode="runtime", strict=True)
    )
    ours = copy.deepcopy(base)
    h = loraweave.apply(
        ours,
        [loraweave.AdapterSpec(sd, name=n) for n, sd in zip(names, sds, strict=True)],
        mode="runtime",
        strict=True,
    )
    keep.append(h)
    exact = copy.deepcopy(base)
    he = loraweave.apply(
        exact,
        [loraweave.AdapterSpec(sd, name=n) for n, sd in zip(names, sds, strict=True)],
        mode="runtime",
        strict=True,
    )
    keep.append(he)
    copies = []
    for sd in sds:
        m = copy.deepcopy(base)
        keep.append(loraweave.apply(m, sd, mode="runtime", strict=True))
        copies.append(m)

    batch = h.batch([[n] for n in names])
    batch.__enter__()  # once, as a server would for a whole denoising loop; closed when the handle goes
    keep.append(batch)
    exact_batch = he.batch([[n] for n in names], exact=True)
    exact_batch.__enter__()
    keep.append(exact_batch)

    def run_ours():
        with torch.inference_mode():
            return ours(x)

    def run_exact():
        with torch.inference_mode():
            return exact(x)

    def run_sequential():
        with torch.inference_mode():
            return torch.cat([m(x[i : i + 1]) for i, m in enumerate(copies)])

    concat, bmm = hand_concat(base, sds, layers), hand_bmm(base, sds, layers)
    ref = run_sequential()
    scale = float(ref.abs().max())
    errors = {
        n: float((f() - ref).abs().max()) / scale
        for n, f in (
            ("ours", run_ours),
            ("exact", run_exact),
            ("concat", lambda: concat(x)),
            ("bmm", lambda: bmm(x)),
        )
    }
    variants = [
        Variant("shared", inference_forward(shared, x)),
        Variant("ours", run_ours),
        Variant("exact", run_exact),
        Variant("sequential", run_sequential),
        Variant("concat", lambda: concat(x)),
        Variant("bmm", lambda: bmm(x)),
    ]
    return variants, errors, keep


def region_variants(layers: int, tokens: int):
    import loraweave

    g = torch.Generator().manual_seed(1)
    base = Stack(layers, g)
    sd = lora(layers, g)
    x = torch.randn(1, tokens, DIM, generator=g)
    side = int(tokens**0.5)
    plain, masked = copy.deepcopy(base), copy.deepcopy(base)
    keep = [loraweave.apply(plain, loraweave.AdapterSpec(sd, name="a"), mode="runtime", strict=True)]
    h = loraweave.apply(masked, loraweave.AdapterSpec(sd, name="a"), mode="runtime", strict=True)
    mask = torch.zeros(side, side)
    mask[:, : side // 2] = 1.0
    h.set_region("a", mask)
    keep.append(h)
    return [
        Variant("plain runtime", inference_forward(plain, x)),
        Variant("region", inference_forward(masked, x)),
    ], keep


def report(res, ref: str, diffs: dict[str, str]) -> str:
    rows = [[ref, *reference_cells(res, ref), "-"]]
    rows += [[name, *variant_cells(res, name), diffs.get(name, "-")] for name in res.times if name != ref]
    return table(
        [
            "variant",
            "median ms",
            "IQR/2",
            f"ratio to {ref}",
            "ratio all",
            "quiet",
            "overhead",
            "max rel diff",
        ],
        rows,
    )


def main() -> None:
    def extra(ap):
        ap.add_argument("--layers", type=int, default=1)
        ap.add_argument("--tokens", type=int, default=4096, help="tokens per sample (a square number)")

    args = benchutil.parse_args(__doc__, quick=2, full=4, extra=extra)
    benchutil.setup_torch()
    benchutil.header(
        f"bench_persample: {args.layers} x Linear({DIM}, {DIM}) fp32, {SAMPLES} samples x {args.tokens} "
        f"tokens, rank {RANK}"
    )
    variants, errors, _keep = batch_variants(args.layers, args.tokens)
    res = sandwiched(variants[0], variants[1:], rounds=args.rounds, warmup=1)
    print(report(res, "shared", {n: f"{e:.1e} vs sequential" for n, e in errors.items()}))
    benchutil.print_legend(args.rounds, res, "shared")
    del variants, _keep
    variants, _keep = region_variants(args.layers, args.tokens)
    rounds = max(args.rounds * 4, 8)
    res = sandwiched(variants[0], variants[1:], rounds=rounds, warmup=1)
    print(report(res, "plain runtime", {}))
    benchutil.print_legend(rounds, res, "plain runtime")


if __name__ == "__main__":
    main()
