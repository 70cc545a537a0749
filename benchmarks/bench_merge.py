"""Merge-mode cost: loraweave's whole `apply(mode="merge")` vs PEFT's merge_and_unload vs a roofline.

Model: 100 x Linear(3072, 3072) fp32 under `layers.{i}` (3.5 GiB of weights). Adapter: rank-16 kohya LoRA with
`.alpha` (scale 0.5) for every layer, written once to a .safetensors file. Variants, timed round-robin with the
order rotated each round, all under torch.no_grad():

  loraweave  loraweave.apply(model, path, mode="merge"): file open + header parse + key parse + resolve +
             backup + merge. handle.remove() runs after the timer (untimed).
  peft       PeftModel.merge_and_unload() only. get_peft_model(...) injection and loading the same factors
             into lora_A/lora_B run before the timer; after it the delta is subtracted again (untimed) so the
             weights stay near their originals. PEFT keeps no backup, so it does less work than an undoable
             merge: it is a reference, not the target.
  roofline   per touched weight: backup = W.clone(); W.addmm_(B, A, alpha=scale), factors already in memory
             (the minimum an undoable merge must do). Weights restored from the backups after the timer.
  plan       loraweave.plan(model, path): open + parse + resolve only (how much of `loraweave` is not merging).

The roofline is timed between every two other variants (see benchutil.sandwiched): each sample is divided by
the mean of the roofline runs right before and after it, which cancels the host's speed swings.

At most two model-sized sets of tensors are alive at any time (the weights and one set of backups).
The peak RSS growth of loraweave's first merge (before any timing, fresh heap) is reported relative to the
bytes of the weights it touched (the backups alone are 1.0x).

    .venv/bin/python benchmarks/bench_merge.py [--quick] [--rounds N] [--layers N]
"""

from __future__ import annotations

import os
import tempfile

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import PeakRss, Variant, median, sandwiched, spread, table

D = 3072
RANK = 16
ALPHA = 8.0
SCALE = ALPHA / RANK


class Net(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        with torch.device("meta"):
            self.layers = torch.nn.ModuleList(torch.nn.Linear(D, D) for _ in range(n))
        self.to_empty(device="cpu")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for lin in self.layers:
                lin.weight.uniform_(-(D**-0.5), D**-0.5, generator=g)
                lin.bias.zero_()


def make_lora(n: int, path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    downs = [torch.randn(RANK, D, generator=g) / D**0.5 for _ in range(n)]
    ups = [torch.randn(D, RANK, generator=g) * 0.01 for _ in range(n)]
    sd = {}
    for i in range(n):
        sd[f"lora_unet_layers_{i}.lora_down.weight"] = downs[i]
        sd[f"lora_unet_layers_{i}.lora_up.weight"] = ups[i]
        sd[f"lora_unet_layers_{i}.alpha"] = torch.tensor(ALPHA)
    save_file(sd, path, metadata={"ss_network_dim": str(RANK), "ss_network_alpha": str(ALPHA)})
    return downs, ups


def main() -> None:
    args = benchutil.parse_args(
        __doc__, quick=2, full=7, extra=lambda ap: ap.add_argument("--layers", type=int, default=100)
    )
    rounds = args.rounds
    n = args.layers
    benchutil.setup_torch()
    benchutil.header(f"bench_merge: {n} x Linear({D}, {D}) fp32, rank-{RANK} kohya LoRA file, merge")

    from peft import LoraConfig, get_peft_model

    import loraweave

    tmp = tempfile.TemporaryDirectory(prefix="lw_bench_merge_")
    path = os.path.join(tmp.name, "lora.safetensors")
    model = Net(n)
    downs, ups = make_lora(n, path)
    weights = [lin.weight for lin in model.layers]
    touched = sum(w.numel() * w.element_size() for w in weights)
    file_mib = os.path.getsize(path) / 2**20

    # First loraweave merge in a fresh heap: its peak RSS growth is what a user pays.
    with torch.no_grad():
        w0 = weights[0].clone()
        with PeakRss() as pk:
            h = loraweave.apply(model, path, mode="merge", strict=True)
        assert h.report.keys_applied == h.report.keys_total == 3 * n, h.report.summary()
        delta = (weights[0] - w0).abs().max().item()
        merge_err = (weights[0] - torch.addmm(w0, ups[0], downs[0], alpha=SCALE)).abs().max().item()
        h.remove()
        restored = torch.equal(weights[0], w0)
        del h, w0

    state: dict = {}
    lora_targets = [f"layers.{i}" for i in range(n)]

    def lw_run():
        state["h"] = loraweave.apply(model, path, mode="merge")

    def lw_cleanup():
        state.pop("h").remove()

    def plan_run():
        return loraweave.plan(model, path)

    def peft_prepare():
        cfg = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=lora_targets, lora_dropout=0.0)
        pm = get_peft_model(model, cfg)
        for i in range(n):
            layer = pm.base_model.model.layers[i]
            layer.lora_A["default"].weight.copy_(downs[i])
            layer.lora_B["default"].weight.copy_(ups[i])
        state["pm"] = pm

    def peft_run():
        out = state.pop("pm").merge_and_unload()
        assert out is model

    def peft_cleanup():
        for w, a, b in zip(weights, downs, ups, strict=True):
            w.addmm_(b, a, alpha=-SCALE)

    def roof_run():
        backups = []
        for w, a, b in zip(weights, downs, ups, strict=True):
            backups.append(w.clone())
            w.addmm_(b, a, alpha=SCALE)
        state["backups"] = backups

    def roof_cleanup():
        for w, b in zip(weights, state.pop("backups"), strict=True):
            w.copy_(b)

    others = [
        Variant("loraweave", lw_run, cleanup=lw_cleanup),
        Variant("peft", peft_run, prepare=peft_prepare, cleanup=peft_cleanup),
        Variant("plan", plan_run),
    ]
    with torch.no_grad():
        res = sandwiched(
            Variant("roofline", roof_run, cleanup=roof_cleanup), others, rounds=rounds, warmup=1, tol=0.05
        )

    t_roof = res.times["roofline"]
    rows = [
        [
            "roofline",
            f"{median(t_roof) * 1e3:.0f}",
            f"+-{spread(t_roof) * 100:.1f}%",
            "1.000",
            "-",
            "-",
            f"{median(t_roof) * 1e3 / n:.2f}",
        ]
    ]
    for v in others:
        t = res.times[v.name]
        rows.append(
            [
                v.name,
                f"{median(t) * 1e3:.0f}",
                f"+-{spread(t) * 100:.1f}%" if rounds >= 4 else "-",
                f"{res.ratio(v.name):.3f}",
                f"{median(res.ratios[v.name]):.3f}",
                res.quiet_count(v.name),
                f"{median(t) * 1e3 / n:.2f}",
            ]
        )
    print()
    benchutil.print_legend(rounds, res, ref="roofline", extra=f"; weights touched {touched / 2**30:.2f} GiB")
    print(table(["variant", "median ms", "IQR/2", "ratio", "ratio all", "quiet", "ms/layer"], rows))
    print()
    lw = res.ratio("loraweave")
    print(f"target: loraweave <= 1.25x roofline: {lw:.3f}x -> {'PASS' if lw <= 1.25 else 'FAIL'}")
    print(f"loraweave vs peft merge_and_unload: {lw / res.ratio('peft'):.3f}x")
    print(
        "what peft's time covers: merge_and_unload() only (delta = B@A*scale, W += delta, module swap); "
        "no backup, no file I/O"
    )
    print()
    print(
        table(
            ["memory / correctness", "value"],
            [
                ["weights touched MiB", f"{touched / 2**20:.0f}"],
                ["adapter file MiB", f"{file_mib:.1f}"],
                ["loraweave first merge: peak RSS growth MiB", f"{pk.delta_mib:.0f}"],
                ["  relative to weights touched", f"{pk.delta_mib * 2**20 / touched:.3f}x"],
                ["  (peak reset via clear_refs)", str(pk.reset)],
                ["max |merged - roofline| layer 0", f"{merge_err:.2e}"],
                ["max |merged - original| layer 0", f"{delta:.2e}"],
                ["handle.remove() restores layer 0 bit-exactly", str(restored)],
            ],
        )
    )
    tmp.cleanup()


if __name__ == "__main__":
    main()
