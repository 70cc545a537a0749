"""Runtime-mode OFT / BOFT forward: loraweave's output rotation vs the merged weight vs the plain layer.

One Linear(3072, 3072) fp32 with bias, input of 4096 tokens x 3072. LyCORIS-style files (keys `oft_blocks`,
`alpha` = constraint 0, LyCORIS's default: unconstrained; no `rescale`), block shapes as LyCORIS 4.x computes
them for out_dim 3072 (its DiagOFTModule / ButterflyOFTModule are instantiated to get the shapes):

  oft b4 (default)  diag-oft, lora_dim=4 (create_lycoris's default): factorization(3072, 4) -> 768 blocks of
                    4x4
  oft b32           diag-oft, lora_dim=32 -> 96 blocks of 32x32
  boft b24 m8       boft, lora_dim=32 (4 is impossible for 3072 under BOFT's constraints) -> 8 stages of
                    128 blocks of 24x24 (oft_blocks (8, 128, 24, 24))

The blocks are random (LyCORIS zero-inits them, which would be the identity rotation).

Variants, each on its own copy of the same weights, timed round-robin (order rotated every round) under
inference_mode, every sample divided by the mean of the base runs either side (benchutil.sandwiched):

  base              plain nn.Linear
  oft b4 (default)  loraweave.apply(module, state_dict, mode="runtime"): forward hook, y = b + rot(x Wᵀ)
  oft b32           the same for 32x32 blocks
  boft b24 m8       the same for the butterfly
  merged            loraweave.apply(..., mode="merge") of oft b32: a plain Linear with W' = blockdiag(R)ᵀ W,
                    which must cost what base costs

Prints median ms, ratio to base, extra MACs per token, output agreement (runtime vs merged for every file, and
both against LyCORIS's own wrapped forward), and (in child processes with glibc's default malloc) the peak RSS
growth of one steady-state forward plus the memory the applied form keeps.

    .venv/bin/python benchmarks/bench_oft.py [--quick] [--rounds N] [--no-mem]
"""

from __future__ import annotations

import copy
import gc
import json

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import (
    PeakRss,
    Variant,
    Wrap,
    inference_forward,
    linear_model,
    reference_cells,
    rss_mib,
    sandwiched,
    table,
    variant_cells,
)

IN = OUT = 3072
TOKENS = 4096
STEM = "lora_unet_proj"
NOISE = 0.01  # std of the random oft_blocks entries (Q = B − Bᵀ): R stays near I, as trained files do
# name -> (LyCORIS algo, lora_dim)
FILES = {"oft b4 (default)": ("diag-oft", 4), "oft b32": ("diag-oft", 32), "boft b24 m8": ("boft", 32)}
MERGED_OF = "oft b32"
VARIANTS = ("base", *FILES, "merged")


def lycoris_module(algo: str, lora_dim: int, lin: torch.nn.Linear):
    """LyCORIS's own module for this algo (constraint 0, no rescale): it decides the block shape."""
    from lycoris.modules.boft import ButterflyOFTModule
    from lycoris.modules.diag_oft import DiagOFTModule

    cls = DiagOFTModule if algo == "diag-oft" else ButterflyOFTModule
    return cls(
        "lycoris_proj", lin, multiplier=1.0, lora_dim=lora_dim, alpha=1.0, constraint=0.0, rescaled=False
    )


def adapters(base: Wrap, g: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    """{name: state dict} with LyCORIS's block shapes and save_weights' keys (oft_blocks, alpha)."""
    out = {}
    for name, (algo, dim) in FILES.items():
        lyco = lycoris_module(algo, dim, copy.deepcopy(base.proj))
        blocks = torch.randn(lyco.oft_blocks.shape, generator=g) * NOISE
        out[name] = {f"{STEM}.oft_blocks": blocks, f"{STEM}.alpha": lyco.alpha.detach().clone()}
        assert float(lyco.alpha) == 0.0
    return out


def build(names: tuple[str, ...]) -> tuple[dict[str, torch.nn.Module], torch.Tensor, dict]:
    """Deterministic set-up of the requested variants (each its own copy of the same weights)."""
    g = torch.Generator().manual_seed(0)
    base = linear_model(IN, OUT, g)
    ads = adapters(base, g)
    x = torch.randn(1, TOKENS, IN, generator=g)
    mods: dict[str, torch.nn.Module] = {}
    handles: list = []  # handles must outlive the timing
    for name in names:
        if name == "base":
            mods[name] = base
            continue
        mods[name] = copy.deepcopy(base)
        handles.append(apply_variant(name, mods[name], ads))
    return mods, x, {"handles": handles, "adapters": ads, "base": base}


def apply_variant(name: str, model: Wrap, ads: dict[str, dict[str, torch.Tensor]]):
    """loraweave.apply of the variant's file onto `model`: runtime, or merge for `merged`."""
    import loraweave

    sd, mode = (ads[MERGED_OF], "merge") if name == "merged" else (ads[name], "runtime")
    h = loraweave.apply(model, sd, mode=mode, strict=True)
    assert h.report.keys_applied == h.report.keys_total == len(sd), h.report.summary()
    return h


def mem_child(name: str) -> None:
    """Peak RSS growth of one steady-state forward, and RSS kept by apply + the first forward, as JSON."""
    torch.set_num_threads(benchutil.THREADS)
    import loraweave  # noqa: F401  (imported before the RSS baseline: its import is not the form's memory)

    mods, x, keep = build(("base",))
    m, handle = mods["base"], None
    with torch.inference_mode():
        m(x)  # the first forward's one-off allocations (BLAS buffers, thread pool) are not counted either
    if name != "base":
        m = copy.deepcopy(m)
    gc.collect()
    before = rss_mib()
    if name != "base":
        handle = apply_variant(name, m, keep["adapters"])
    with torch.inference_mode():
        y = m(x)  # warm-up: the runtime path caches R here
        del y
        gc.collect()
        kept = rss_mib() - before
        with PeakRss() as pk:
            y = m(x)
        del y
    del handle
    print(json.dumps({"name": name, "peak_mib": pk.delta_mib, "kept_mib": kept, "reset": pk.reset}))


@torch.no_grad()
def lycoris_forward(base: Wrap, name: str, sd: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """LyCORIS 4.x's wrapped forward (not bypass; multiplier 1) with the same blocks: the independent
    reference."""
    m = copy.deepcopy(base)
    lyco = lycoris_module(*FILES[name], m.proj)
    lyco.oft_blocks.copy_(sd[f"{STEM}.oft_blocks"])
    lyco.apply_to()
    lyco.eval()
    with torch.inference_mode():
        return m(x)


def extra_macs(sd: dict[str, torch.Tensor]) -> int:
    """Per-token MACs of the rotation: b per output feature per stage."""
    blocks = sd[f"{STEM}.oft_blocks"]
    stages = blocks.shape[0] if blocks.dim() == 4 else 1
    return stages * OUT * blocks.shape[-1]


def main() -> None:
    args = benchutil.parse_args(__doc__, quick=3, full=7, mem=True)
    if args.mem_child:
        mem_child(args.mem_child)
        return
    rounds = args.rounds
    benchutil.setup_torch()
    benchutil.header("bench_oft: Linear(3072, 3072) fp32, x (1, 4096, 3072), OFT/BOFT runtime vs merge")
    from lycoris.logging import logger as lycoris_logger

    lycoris_logger.setLevel("WARNING")  # its factorisation notices would interleave with the tables

    mods, x, keep = build(VARIANTS)
    ads, base = keep["adapters"], keep["base"]
    import loraweave

    agree = []
    with torch.inference_mode():
        y_base = mods["base"](x)
        scale_y, d_max = float(y_base.abs().max()), 0.0
        for name, sd in ads.items():
            y_run = mods[name](x)
            if name == MERGED_OF:
                y_merged = mods["merged"](x)
            else:  # merged outputs of the other files: computed here, not timed
                m = copy.deepcopy(base)
                h = loraweave.apply(m, sd, mode="merge", strict=True)
                assert h.report.keys_applied == h.report.keys_total == len(sd)
                y_merged = m(x)
                del m, h
            y_lyco = lycoris_forward(base, name, sd, x)
            d_max = max(d_max, float((y_lyco - y_base).abs().max()))
            agree += [
                [f"{name}: runtime vs merged", f"{float((y_run - y_merged).abs().max()):.3e}"],
                [f"{name}: runtime vs LyCORIS forward", f"{float((y_run - y_lyco).abs().max()):.3e}"],
                [f"{name}: merged vs LyCORIS forward", f"{float((y_merged - y_lyco).abs().max()):.3e}"],
            ]
            del y_run, y_merged, y_lyco
        del y_base
    gc.collect()

    others = [Variant(n, inference_forward(mods[n], x)) for n in VARIANTS[1:]]
    res = sandwiched(Variant("base", inference_forward(mods["base"], x)), others, rounds=rounds, warmup=1)

    macs = {"base": 0, "merged": 0, **{n: extra_macs(sd) for n, sd in ads.items()}}
    shapes = {
        "base": "-",
        "merged": f"{MERGED_OF}, merged",
        **{n: "x".join(str(d) for d in sd[f"{STEM}.oft_blocks"].shape) for n, sd in ads.items()},
    }
    rows = [["base", "-", *reference_cells(res, "base"), "0"]]
    rows += [[v.name, shapes[v.name], *variant_cells(res, v.name), str(macs[v.name])] for v in others]
    print()
    benchutil.print_legend(rounds, res)
    print(
        table(
            [
                "variant",
                "oft_blocks",
                "median ms",
                "IQR/2",
                "ratio",
                "ratio all",
                "quiet",
                "overhead",
                "extra MACs/token",
            ],
            rows,
        )
    )
    print(f"(base GEMM: {IN * OUT} MACs/token)")
    print()
    print(f"output agreement (max |y| = {scale_y:.3f}; the adapters change y by up to {d_max:.3f}):")
    print(table(["pair", "max abs diff"], agree))
    if not args.no_mem:
        print()
        mem = benchutil.mem_children(__file__, VARIANTS)
        print(
            f"memory: peak RSS growth of one steady-state forward (child process per variant, default glibc "
            f"malloc; the output tensor alone is {TOKENS * OUT * 4 / 2**20:.0f} MiB), and the RSS the "
            f"applied "
            "form keeps after apply + one forward (runtime: cached R; merge: the weight backup for remove())"
        )
        b = mem["base"]["peak_mib"]
        print(
            table(
                ["variant", "peak delta MiB", "vs base", "kept MiB"],
                [
                    [
                        n,
                        f"{mem[n]['peak_mib']:.1f}",
                        f"{mem[n]['peak_mib'] / b:.2f}x" if b else "-",
                        "-" if n == "base" else f"{mem[n]['kept_mib']:.1f}",
                    ]
                    for n in VARIANTS
                ],
            )
        )


if __name__ == "__main__":
    main()
