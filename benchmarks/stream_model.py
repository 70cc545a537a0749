"""What the streaming schedule should give on a GPU, before one is measured: a timing model, not a
measurement.

The real StreamHandle runs a tiny Flux stack (same block structure as Flux.1: 19 double + 38 single blocks by
default) on CPU, while its copies and block computes are timed on a virtual clock with Flux.1-width numbers:
each block's bf16 bytes (plus its rank-16 LoRA factors) from a meta-device FluxTransformer2DModel, copied at
an assumed host-to-device bandwidth on one copy engine; each block's compute = its FLOPs at 1024x1024 with CFG
(batch 2, 4096 image + 512 text tokens; linear layers by the tokens each sees, plus attention) at an assumed
rate. The planner and ledger see the real bytes, so plans are the ones a Flux.1 run would get. The handle's
own calls drive the clock: a copy starts when the copy engine is free and compute has released its slot (the
`freed` event), compute waits for the copy (`ready`). Not modelled: the rest of the model (embedders,
norm_out), kernel launch gaps, contention between copy and compute for memory bandwidth.

    .venv/bin/python benchmarks/stream_model.py [--bandwidths 25,50] [--efficiency 0.6]

Prints, per bandwidth, budget and placement (prefix: sd.cpp's resident prefix; spread): resident/streamed
blocks, modelled step time and its ratio to fully resident (the issue-8 target: >= 0.8x at 50 %), stall time
and how busy the copy engine is. benchmarks/stream_gpu.py measures the same settings on a CUDA device.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

PEAK_FLOPS = 790e12  # bf16 matmul measured on this workplace's H200 (8192^3 products, KINDS.md)
RANK = 16


def flux(double: int, single: int, width: bool, device: str = "cpu") -> nn.Module:
    from diffusers import FluxTransformer2DModel

    cfg = (
        dict(
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            axes_dims_rope=[16, 56, 56],
            in_channels=64,
        )
        if width
        else dict(
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            axes_dims_rope=[4, 6, 6],
            in_channels=16,
        )
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = FluxTransformer2DModel(
            patch_size=1, num_layers=double, num_single_layers=single, guidance_embeds=True, **cfg
        )
    return model.eval().requires_grad_(False)


def tokens_seen(block_kind: str, name: str, img: int, txt: int) -> int:
    """Tokens a Linear inside a Flux block multiplies (modulation linears see one vector per sample)."""
    if ".norm" in name or name.startswith("norm"):
        return 1
    if block_kind == "single":
        return img + txt
    return txt if ("context" in name or "add_" in name) else img


def real_costs(double: int, single: int, img: int, txt: int, batch: int) -> dict[str, tuple[int, float]]:
    """{block name: (bytes on the device incl. LoRA factors, FLOPs of one forward)} at Flux.1 widths, bf16."""
    model = flux(double, single, width=True, device="meta").to(torch.bfloat16)
    out = {}
    for kind, blocks, prefix in (
        ("double", model.transformer_blocks, "transformer_blocks"),
        ("single", model.single_transformer_blocks, "single_transformer_blocks"),
    ):
        for i, block in enumerate(blocks):
            nbytes = sum((p.numel() * 2 + 255) // 256 * 256 for p in block.parameters())
            flops = 0.0
            for name, m in block.named_modules():
                if isinstance(m, nn.Linear):
                    nbytes += (
                        (m.in_features * RANK * 2 + 255) // 256 + (m.out_features * RANK * 2 + 255) // 256
                    ) * 256
                    flops += (
                        2.0
                        * batch
                        * tokens_seen(kind, name, img, txt)
                        * (m.in_features + RANK)
                        * m.out_features
                    )
            heads, dim = 24, 128
            flops += 4.0 * batch * heads * (img + txt) ** 2 * dim  # QK^T and PV
            out[f"{prefix}.{i}"] = (nbytes, flops)
    rest = sum(p.numel() * 2 for n, p in model.named_parameters() if "transformer_blocks" not in n)
    out["rest"] = (rest, 0.0)
    return out


def step(model, kw) -> None:
    with torch.no_grad():
        model(**kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--double", type=int, default=19)
    ap.add_argument("--single", type=int, default=38)
    ap.add_argument(
        "--bandwidths", default="25,50", help="host-to-device GB/s to model (PCIe 5 x16 peaks near 55)"
    )
    ap.add_argument(
        "--efficiency", type=float, default=0.6, help="fraction of the bf16 peak the blocks reach"
    )
    ap.add_argument("--budgets", default="1.0,0.75,0.5,0.25")
    args = ap.parse_args()

    import loraweave
    from loraweave.streaming import handle as handle_module
    from loraweave.streaming import stream
    from loraweave.streaming.clock import ClockCopier
    from loraweave.streaming.store import Unit

    torch.set_num_threads(1)
    costs = real_costs(args.double, args.single, img=4096, txt=512, batch=2)
    rate = PEAK_FLOPS * args.efficiency
    blocks = [k for k in costs if k != "rest"]
    total = sum(costs[k][0] for k in costs)
    resident_s = sum(costs[k][1] for k in blocks) / rate

    model = flux(args.double, args.single, width=False)
    g = torch.Generator().manual_seed(7)
    sd = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            sd[f"transformer.{name}.lora_A.weight"] = torch.randn(RANK, m.in_features, generator=g) * 0.01
            sd[f"transformer.{name}.lora_B.weight"] = torch.randn(m.out_features, RANK, generator=g) * 0.01
    loraweave.apply(model, sd, mode="runtime")
    kw = dict(
        hidden_states=torch.randn(2, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(2, 5, 32, generator=g),
        pooled_projections=torch.randn(2, 32, generator=g),
        timestep=torch.tensor([0.5, 0.5]),
        guidance=torch.tensor([3.5, 3.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(5, 3),
        return_dict=False,
    )

    real_set_factors, real_copier = Unit.set_factors, handle_module.Copier

    def set_factors_real_bytes(
        self, paths
    ):  # the planner and ledger count Flux.1-width bytes (rest included)
        real_set_factors(self, paths)
        self.nbytes = costs[self.name][0]

    Unit.set_factors = set_factors_real_bytes
    print(
        f"Flux.1 widths, {args.double} double + {args.single} single blocks, bf16 + rank-{RANK} LoRA: "
        f"{total / 2**30:.2f} GiB; resident step (blocks only) {resident_s * 1e3:.0f} ms at "
        f"{rate / 1e12:.0f} TFLOP/s"
    )
    print(
        f"{'GB/s':>5} {'budget':>6} {'placement':>9} {'resident':>8} {'streamed':>8} {'step ms':>8} "
        f"{'x resident':>10} {'stall ms':>8} {'copy busy':>9}"
    )
    for bw in (float(b) * 1e9 for b in args.bandwidths.split(",")):
        copy_seconds = lambda unit, bw=bw: costs[unit.name][0] / bw  # noqa: E731
        for frac in (float(f) for f in args.budgets.split(",")):
            for placement in ("prefix",) if frac >= 1 else ("prefix", "spread"):
                made = []
                handle_module.Copier = lambda device, made=made, f=copy_seconds: (
                    made.append(ClockCopier(device, f)) or made[-1]
                )
                # + 1 MiB: the tiny model's kept adapter bytes (scale vectors, the rest's factors), ~100 KiB
                s = stream(
                    model, budget=int(total * frac) + 2**20, device="cpu", margin=0, placement=placement
                )
                hooks = []
                for unit in s.units:  # compute time lands before the handle's post-hook records `freed`
                    seconds = costs[unit.name][1] / rate
                    hooks.append(
                        unit.module.register_forward_hook(
                            lambda *a, c=made, t=seconds: c[-1].advance(t), prepend=True
                        )
                    )
                for _ in range(2):  # the first forward learns the call order
                    step(model, kw)
                clock = made[-1]
                t0, stall0, busy0 = clock.now, clock.stall, clock.busy
                step(model, kw)
                t = clock.now - t0
                print(
                    f"{bw / 1e9:>5.0f} {frac:>6.0%} {placement:>9} {sum(s.plan.resident):>8} "
                    f"{len(s.plan.streamed):>8} {t * 1e3:>8.0f} {resident_s / t:>10.2f} "
                    f"{(clock.stall - stall0) * 1e3:>8.0f} {(clock.busy - busy0) / t:>9.0%}"
                )
                for h in hooks:
                    h.remove()
                s.close()
    Unit.set_factors, handle_module.Copier = real_set_factors, real_copier


if __name__ == "__main__":
    main()
