"""LoRA strength change and LoRA swap on a stack of Nunchaku SVDQW4A4Linear layers: loraweave against the
seed loader (ComfyUI-QwenImageLoraLoader `nunchaku_code/lora_qwen.py`, used in place).

Model: `--blocks` blocks (default 8) of four real SVDQW4A4Linear layers at Flux width, bf16, rank 32
(`layers.N.attention.to_qkv` 3072->9216, `.attention.to_out.0` 3072->3072, `.mlp.fc1` 3072->12288, `.mlp.fc2`
12288->3072), on the CPU stand-in for `nunchaku._C` (tests/helpers/nunchaku_cpu.py; no forward is timed: only
the edits of the low-rank branch). Adapters A and B: rank-16 LoRAs on every layer, held in memory.

Timed per round (round-robin, medians), each side on its own copy of the stack:
  strength change  ours: handle.set_strength("A", s); seed: compose_loras_v2(model, [(A, s)]) (what its
                   wrapper runs when a strength changes: reset, then unpack/concatenate/repack every layer)
  swap A->B        ours: handle.switch(B); seed: compose_loras_v2(model, [(B, 1)])
  re-apply B       ours: handle.remove() + loraweave.apply(model, B)
Target: ours under 5 % of the seed's time for both. Peak RSS growth of one operation of each (in-process,
/proc/self/clear_refs). Also checked, untimed: after A at strength 1 both sides hold the same packed tensors,
and the seed's in-place `set_lora_strength_v2` (a slice of the PACKED proj_up) against the exact rescale.

    .venv/bin/python benchmarks/bench_nunchaku.py [--quick] [--blocks N] [--threads N]
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
from pathlib import Path

import benchutil  # first: re-execs with the malloc settings before torch is loaded
import torch
from benchutil import PeakRss, Variant, interleaved, median, table
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
SEED_LOADER = REPO.parent / "shared" / "quantized" / "ComfyUI-QwenImageLoraLoader"
WIDTH, RANK, LORA_RANK = 3072, 32, 16
SHAPES = {  # name in a block: (out, in)
    "attention.to_qkv": (3 * WIDTH, WIDTH),
    "attention.to_out.0": (WIDTH, WIDTH),
    "mlp.fc1": (4 * WIDTH, WIDTH),
    "mlp.fc2": (WIDTH, 4 * WIDTH),
}


def build(blocks: int) -> torch.nn.Module:
    """Real SVDQW4A4Linear layers; the int4 weights stay uninitialised (never read: no forward here)."""
    from helpers import nunchaku_cpu

    linear = nunchaku_cpu.import_nunchaku("nunchaku.models.linear")
    g = torch.Generator().manual_seed(0)
    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList()
    for _ in range(blocks):
        block = torch.nn.Module()
        for name, (out, inp) in SHAPES.items():
            layer = linear.SVDQW4A4Linear(inp, out, rank=RANK, torch_dtype=torch.bfloat16)
            with torch.no_grad():
                layer.proj_down.copy_(torch.randn(inp, RANK, generator=g) * 0.02)
                layer.proj_up.copy_(torch.randn(out, RANK, generator=g) * 0.02)
            parent = block
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, layer)
        root.layers.append(block)
    return root


def lora(blocks: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(blocks):
        for name, (out, inp) in SHAPES.items():
            sd[f"layers.{i}.{name}.lora_A.weight"] = torch.randn(LORA_RANK, inp, generator=g) * 0.01
            sd[f"layers.{i}.{name}.lora_B.weight"] = torch.randn(out, LORA_RANK, generator=g) * 0.01
    return sd


def svdq_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if type(m).__name__ == "SVDQW4A4Linear"}


def same_tensors(ours: torch.nn.Module, seed: torch.nn.Module) -> bool:
    a, b = svdq_layers(ours), svdq_layers(seed)
    return all(
        torch.equal(a[n].proj_down, b[n].proj_down) and torch.equal(a[n].proj_up, b[n].proj_up) for n in a
    )


def seed_inplace_strength_error(seed_model, compose, set_strength, sd, path) -> float:
    """The seed's `set_lora_strength_v2(model, 0.5)` scales columns base_rank: of the PACKED proj_up; ρ-style
    relative error of the resulting ΔW against the exact half-strength ΔW, worst layer."""
    from loraweave.quant.nunchaku import unpack_lowrank

    compose(seed_model, [(path, 1.0)])
    set_strength(seed_model, 0.5)
    worst = 0.0
    for name, layer in svdq_layers(seed_model).items():
        up = unpack_lowrank(layer.proj_up.detach(), down=False).double()[:, RANK:]
        down = unpack_lowrank(layer.proj_down.detach(), down=True).double()[RANK:]
        want = 0.5 * sd[f"{name}.lora_B.weight"].double() @ sd[f"{name}.lora_A.weight"].double()
        worst = max(worst, float((up @ down - want).norm() / want.norm()))
    return worst


def seed_needs_comfy_utils() -> None:
    """The seed loader reads its files with `comfy.utils.load_torch_file`: without ComfyUI, the same read of a
    .safetensors file (safetensors.torch.load_file, ComfyUI's path for that suffix)."""
    import types

    from safetensors.torch import load_file

    if "comfy.utils" in sys.modules:
        return
    comfy, utils = types.ModuleType("comfy"), types.ModuleType("comfy.utils")

    def load_torch_file(path, *_args, **_kwargs):
        return load_file(path)

    utils.load_torch_file = load_torch_file
    comfy.utils = utils
    sys.modules.setdefault("comfy", comfy)
    sys.modules["comfy.utils"] = utils


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 rounds instead of 10")
    ap.add_argument("--blocks", type=benchutil.positive_int, default=8)
    ap.add_argument("--threads", type=benchutil.positive_int, default=None, help="default: torch's")
    args = ap.parse_args()
    rounds = 3 if args.quick else 10
    if args.threads:
        torch.set_num_threads(args.threads)
    layers = args.blocks * len(SHAPES)
    benchutil.header(f"bench_nunchaku: {layers} SVDQW4A4Linear layers (width {WIDTH}, rank {RANK}), LoRA r16")
    from helpers import nunchaku_cpu

    nunchaku_cpu.import_nunchaku("nunchaku.lora.flux.nunchaku_converter")  # the seed loader imports it
    sys.path.insert(0, str(SEED_LOADER))
    seed_needs_comfy_utils()
    from nunchaku_code import lora_qwen

    import loraweave
    from loraweave.request.spec import AdapterSpec

    for name in ("nunchaku_code.lora_qwen", "loraweave"):
        import logging

        logging.getLogger(name).setLevel(logging.WARNING)
    ours_model = build(args.blocks)
    seed_model = copy.deepcopy(ours_model)
    tmp = Path(tempfile.mkdtemp(prefix="bench_nunchaku_"))
    tensors = {"A": lora(args.blocks, 1), "B": lora(args.blocks, 2)}
    sets = {}
    for name, sd in tensors.items():  # both sides read the same files, as a loader node does
        sets[name] = str(tmp / f"{name}.safetensors")
        save_file(sd, sets[name])
    state = {"handle": loraweave.apply(ours_model, AdapterSpec(sets["A"], name="A")), "s": 1.0, "seed_s": 1.0}
    lora_qwen.compose_loras_v2(seed_model, [(sets["A"], 1.0)])
    identical = same_tensors(ours_model, seed_model)
    mechanisms = sorted({a.mechanism for a in state["handle"].report.applied})

    def ours_strength(st=state):
        st["s"] = 1.5 - st["s"]
        st["handle"].set_strength("A", st["s"])

    def seed_strength(st=state):
        st["seed_s"] = 1.5 - st["seed_s"]
        lora_qwen.compose_loras_v2(seed_model, [(sets["A"], st["seed_s"])])

    def ours_to(name, st=state):
        return lambda: st["handle"].switch(AdapterSpec(sets[name], name=name))

    def seed_to(name):
        return lambda: lora_qwen.compose_loras_v2(seed_model, [(sets[name], 1.0)])

    def ours_reapply(st=state):
        st["handle"].remove()
        st["handle"] = loraweave.apply(ours_model, AdapterSpec(sets["B"], name="B"))

    variants = [
        Variant("ours strength change", ours_strength),
        Variant("seed strength change", seed_strength),
        Variant("ours swap A->B", ours_to("B"), cleanup=ours_to("A")),
        Variant("seed swap A->B", seed_to("B"), cleanup=seed_to("A")),
        Variant("ours re-apply B", ours_reapply, cleanup=ours_to("A")),
    ]
    times = interleaved(variants, rounds=rounds, warmup=1, log=False, collect=False)
    peaks = {}
    for v in variants:
        with PeakRss() as pk:
            v.run()
        if v.cleanup is not None:
            v.cleanup()
        peaks[v.name] = pk.delta_mib
    med = {name: median(ts) for name, ts in times.items()}
    rows = []
    for op, ours_name, seed_name in (
        ("strength change", "ours strength change", "seed strength change"),
        ("swap A->B", "ours swap A->B", "seed swap A->B"),
        ("swap A->B (re-apply)", "ours re-apply B", "seed swap A->B"),
    ):
        ratio = med[ours_name] / med[seed_name]
        rows.append(
            [
                op,
                f"{med[ours_name] * 1e3:.2f}",
                f"{med[seed_name] * 1e3:.1f}",
                f"{100 * ratio:.2f} %",
                f"{peaks[ours_name]:.1f}",
                f"{peaks[seed_name]:.1f}",
                "PASS" if ratio < 0.05 else "FAIL",
            ]
        )
    print(benchutil.noise_line())
    headers = ["operation", "ours ms", "seed ms", "ours/seed", "ours peak MiB", "seed peak MiB", "< 5 %"]
    print(table(headers, rows))
    print(f"\nours mechanism per layer: {mechanisms}")
    print(f"packed proj_down/proj_up after A at strength 1 identical to the seed's: {identical}")
    state["handle"].remove()
    err = seed_inplace_strength_error(seed_model, lora_qwen.compose_loras_v2, lora_qwen.set_lora_strength_v2,
                                      tensors["A"], sets["A"])  # fmt: skip
    print(
        "seed set_lora_strength_v2(0.5), a slice of the packed proj_up: worst layer "
        f"||ΔW - ΔW_exact|| / ||ΔW_exact|| = {err:.3f}"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
