"""Merge-mode cost: loraweave's whole `apply(mode="merge")` vs PEFT's file-to-merged path and PEFT's merge()
alone.

Model: N x Linear(3072, 3072) fp32 under `layers.{i}` (N = 24 by default: 0.84 GiB of weights). Adapter: a
rank-16 LoRA (scale 0.5) on every layer, written once as a kohya .safetensors file (loraweave reads it) and
once with PEFT's key names (PEFT reads it); the same tensors. Variants, timed round-robin with the order
rotated each round, all under torch.no_grad():

  lw_auto     loraweave.apply(model, path, mode="merge"): file open, parse, resolve, merge, exact undo record
              (compact or copy per layer, the smaller). handle.remove() after the timer.
  lw_none     the same with undo="none" (a permanent fuse). The weights are copied back after the timer.
  peft_file   PEFT's whole path from the file: safetensors load_file, get_peft_model (inject),
              set_peft_model_state_dict, merge_and_unload(). No undo record. Weights copied back after the
              timer.
  peft_merge  PEFT's merge() alone (merge_adapter()): injection and the factors' load happen before the timer.
  str_compact handle.set_strength(...) on a default (compact-undo) merge: W rebuilt from the record, merged
  again.
  str_copy    the same on an undo="copy" merge (W copied back from the full backup).
  roofline    per weight: W.addmm_(B, A, alpha=s), factors in memory: the reference every sample is divided by
              (timed between every two variants, see benchutil.sandwiched; host speed swings cancel).

Targets (issue 28): lw_auto <= 1.0x peft_file, lw_none <= 1.0x peft_merge, str_compact <= 2.5x str_copy, each
the median of the per-round paired ratios of one run. Also printed: the undo record's size relative to the
touched bytes (target <= 10 %), the peak RSS growth of loraweave's first merge, bit-exact remove().

Timed by default twice in one run: on one thread in CPU seconds (steady on a shared host) and at torch's
default thread count in wall seconds (what users run with; issue 39), each with its own targets and a summary
side by side. `--threads N --clock C` times one setting only; `--load N` runs N busy processes beside the
whole run (benchutil.BackgroundLoad).

    .venv/bin/python benchmarks/bench_merge.py [--quick] [--rounds N] [--layers N] [--load N]
        [--threads N --clock cpu|wall]
"""

from __future__ import annotations

import os
import tempfile
import time

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import PeakRss, Variant, median, ratio_median, sandwiched, spread, table

D = 3072
RANK = 16
ALPHA = 8.0
SCALE = ALPHA / RANK
TARGETS = (("lw_auto", "peft_file", 1.0), ("lw_none", "peft_merge", 1.0), ("str_compact", "str_copy", 2.5))


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


def make_lora(n: int, path: str, peft_path: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The kohya file loraweave reads and the PEFT-named file PEFT reads (the same tensors); (downs, ups)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(1)
    downs = [torch.randn(RANK, D, generator=g) / D**0.5 for _ in range(n)]
    ups = [torch.randn(D, RANK, generator=g) * 0.01 for _ in range(n)]
    kohya, peft = {}, {}
    for i in range(n):
        kohya[f"lora_unet_layers_{i}.lora_down.weight"] = downs[i]
        kohya[f"lora_unet_layers_{i}.lora_up.weight"] = ups[i]
        kohya[f"lora_unet_layers_{i}.alpha"] = torch.tensor(ALPHA)
        peft[f"base_model.model.layers.{i}.lora_A.weight"] = downs[i]
        peft[f"base_model.model.layers.{i}.lora_B.weight"] = ups[i]
    save_file(kohya, path, metadata={"ss_network_dim": str(RANK), "ss_network_alpha": str(ALPHA)})
    save_file(peft, peft_path)
    return downs, ups


def main() -> None:
    def options(ap):
        ap.add_argument("--layers", type=int, default=24)
        ap.add_argument("--threads", type=benchutil.positive_int, default=None, help="one setting only")
        ap.add_argument("--clock", choices=("cpu", "wall"), default=None, help="with --threads")
        benchutil.add_load_arg(ap)

    args = benchutil.parse_args(__doc__, quick=3, full=9, extra=options)
    benchutil.setup_torch()
    if args.threads is not None:
        settings = [(args.threads, args.clock or ("cpu" if args.threads == 1 else "wall"))]
    else:
        settings = [(1, "cpu"), (benchutil.DEFAULT_THREADS, "wall")]
    benchutil.header(
        f"bench_merge: {args.layers} x Linear({D}, {D}) fp32, rank-{RANK} LoRA file, merge; "
        f"settings {settings}, --load {args.load}"
    )
    summary = []
    with benchutil.BackgroundLoad(args.load) as load:
        for threads, clock in settings:
            torch.set_num_threads(threads)
            print(f"\n-- torch threads {threads}, clock {clock}; {load.line()}")
            summary.append((threads, clock, run(args.rounds, args.layers, clock)))
            print(f"-- done; {load.line()}")
    print()
    print(f"summary (cpu={benchutil.cpu_model()!r}, --load {args.load}): median of paired ratios")
    rows = [[f"{t} ({c})", *(f"{r:.3f}x" for r in ratios)] for t, c, ratios in summary]
    print(table(["threads (clock)", *(f"{a} / {b}" for a, b, _ in TARGETS)], rows))


def run(rounds: int, n: int, clock_name: str) -> list[float]:
    """One timed setting (torch's thread count already set): the tables; the targets' ratios."""
    clock = time.process_time if clock_name == "cpu" else time.perf_counter

    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    import loraweave

    tmp = tempfile.TemporaryDirectory(prefix="lw_bench_merge_")
    path = os.path.join(tmp.name, "lora.safetensors")
    peft_path = os.path.join(tmp.name, "peft_lora.safetensors")
    model = Net(n)
    downs, ups = make_lora(n, path, peft_path)
    weights = [lin.weight for lin in model.layers]
    touched = sum(w.numel() * w.element_size() for w in weights)
    targets = [f"layers.{i}" for i in range(n)]

    with (
        torch.no_grad()
    ):  # the first loraweave merge in a fresh heap: its peak RSS growth is what a user pays
        w0 = weights[0].clone()
        with PeakRss() as pk:
            h = loraweave.apply(model, path, mode="merge", strict=True)
        assert h.report.keys_applied == h.report.keys_total == 3 * n, h.report.summary()
        record_bytes = h.report.undo_bytes()
        kinds = sorted({m.undo for m in h.report.applied})
        merge_err = (weights[0] - torch.addmm(w0, ups[0], downs[0], alpha=SCALE)).abs().max().item()
        h.set_strength(next(iter(h.strengths)), 0.7)
        h.remove()
        restored = torch.equal(weights[0], w0)
        del h, w0

    state: dict = {}
    # Every sample starts from the model's own weights: subtracting ΔW again (as this script once did) leaves
    # weights that round-trip W + ΔW - ΔW exactly far more often, which made compact records look cheaper.
    pristine = [w.clone() for w in weights]

    def unmerge() -> None:
        for w, p in zip(weights, pristine, strict=True):
            w.copy_(p)

    def lw_auto():
        state["h"] = loraweave.apply(model, path, mode="merge")

    def lw_none():
        loraweave.apply(model, path, mode="merge", undo="none")

    def remove_handle():
        state.pop("h").remove()

    def peft_config():
        return LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)

    def peft_file():
        pm = get_peft_model(model, peft_config())
        set_peft_model_state_dict(pm, load_file(peft_path))
        assert pm.merge_and_unload() is model

    def peft_inject():
        pm = get_peft_model(model, peft_config())
        for i in range(n):
            layer = pm.base_model.model.layers[i]
            layer.lora_A["default"].weight.copy_(downs[i])
            layer.lora_B["default"].weight.copy_(ups[i])
        state["pm"] = pm

    def peft_merge():
        state["pm"].merge_adapter()

    def peft_unload():
        assert state.pop("pm").unload() is model  # unload keeps the merged weights
        unmerge()

    def merged(undo: str):
        def prepare():
            state["h"] = loraweave.apply(model, path, mode="merge", undo=undo)
            state["s"] = 0.5

        return prepare

    def change_strength():
        state["s"] = 1.5 - state["s"]
        state["h"].set_strength(next(iter(state["h"].strengths)), state["s"])

    def roof_run():
        for w, a, b in zip(weights, downs, ups, strict=True):
            w.addmm_(b, a, alpha=SCALE)

    others = [
        Variant("lw_auto", lw_auto, cleanup=remove_handle),
        Variant("lw_none", lw_none, cleanup=unmerge),
        Variant("peft_file", peft_file, cleanup=unmerge),
        Variant("peft_merge", peft_merge, prepare=peft_inject, cleanup=peft_unload),
        Variant("str_compact", change_strength, prepare=merged("auto"), cleanup=remove_handle),
        Variant("str_copy", change_strength, prepare=merged("copy"), cleanup=remove_handle),
    ]
    with torch.no_grad():
        res = sandwiched(
            Variant("roofline", roof_run, cleanup=unmerge),
            others,
            rounds=rounds,
            warmup=1,
            tol=0.05,
            clock=clock,
        )

    rows = [["roofline", f"{median(res.times['roofline']) * 1e3:.0f}", "-", "1.000", "-", "-"]]
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
            ]
        )
    print()
    benchutil.print_legend(rounds, res, ref="roofline", extra=f"; weights touched {touched / 2**30:.2f} GiB")
    print(table(["variant", "median ms", "IQR/2", "ratio", "ratio all", "quiet"], rows))
    print()
    ratios = []
    for name, ref, limit in TARGETS:
        r = ratio_median(res.times[name], res.times[ref])
        ratios.append(r)
        print(
            f"target: {name} <= {limit}x {ref} (median of paired ratios): {r:.3f}x -> "
            f"{'PASS' if r <= limit else 'FAIL'}"
        )
    print()
    print(
        table(
            ["memory / correctness", "value"],
            [
                ["weights touched MiB", f"{touched / 2**20:.0f}"],
                ["undo record kinds", ",".join(kinds)],
                ["undo record / touched bytes (target <= 0.10)", f"{record_bytes / touched:.4f}"],
                ["loraweave first merge: peak RSS growth MiB", f"{pk.delta_mib:.0f}"],
                ["  relative to weights touched", f"{pk.delta_mib * 2**20 / touched:.3f}x"],
                ["max |merged - addmm reference| layer 0", f"{merge_err:.2e}"],
                ["set_strength then remove() restores layer 0 bit-exactly", str(restored)],
            ],
        )
    )
    tmp.cleanup()
    return ratios


if __name__ == "__main__":
    main()
