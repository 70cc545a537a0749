"""How much of a LoRA's ΔW survives on ComfyUI's quantized checkpoints: core LoraLoader against loraweave, per
layout, on the same file. Prints a markdown table (docs/quantized-qc.md holds the measured one).

The model: ComfyUI's own Flux (hidden `--hidden`, 1 double + 1 single block) written as a `comfy_quant` file
of each layout the imported ComfyUI tree registers (tests/helpers/comfy_quant.py; LORAWEAVE_COMFYUI=latest for
the newest tree) and loaded by `comfy.sd.load_diffusion_model`. The LoRA: kohya, rank 16, on every quantized
block Linear, up rescaled so that ‖ΔW‖_F = `ratio`·‖W‖_F on each layer (a realistic LoRA is a few %).

  core     comfy.sd.load_lora_for_models (LoraLoader), the model loaded (ComfyUI patches every weight:
           dequantize, add, requantize with scale recalculated and stochastic rounding), then each weight
           dequantized: ρ = <ΔW_applied, ΔW>/‖ΔW‖², ΔW_applied = dequantize(patched) − dequantize(base),
           ΔW = s·γ·up·down in fp64; ε = ‖ΔW_applied − ΔW‖/‖ΔW‖ (the rounding noise it adds)
  merge    loraweave.comfy.load_lora_for_models(mode="merge"): the ρ its report gives per layer
           (report.to_dict()["applied"][i]["retention"], measured on ComfyUI's own patch path), next to the
           same ρ measured as for core after loading
  nearest  the same requantization with round-to-nearest (`requantize_from_float(W + ΔW, scale="recalculate",
           stochastic_rounding=0)`: what is kept where no stochastic rounding is done, e.g. ComfyUI before
           it came back, #12390)
  auto     loraweave.comfy.load_lora_for_models(mode="auto") = runtime: nothing is rounded into storage; its
           ρ is measured on the layer outputs: <y_lora − y_base, x·ΔWᵀ>/‖x·ΔWᵀ‖² (x random, 64 tokens)

Medians over the layers (min in brackets).

    LORAWEAVE_COMFYUI=latest .venv/bin/python benchmarks/bench_comfy_quantized.py [--hidden 512]
        [--ratios 0.01,0.03,0.1] [--rank 16] [--seed 0] [--formats nvfp4,fp8_scaled,...]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from helpers.comfy_env import COMFYUI_TREE, import_comfy  # noqa: E402
from helpers.comfy_quant import flux_sd, formats, layout_of, load_flux, quantized_linears  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from loraweave.comfy import load_lora_for_models  # noqa: E402
from loraweave.comfy.quantized import dequantized  # noqa: E402
from loraweave.quant.comfy_kitchen import is_quantized_tensor  # noqa: E402

STRENGTH = 1.0


def lora_file(layers: dict, ratio: float, rank: int, seed: int) -> tuple[dict, dict[str, torch.Tensor]]:
    """(kohya state dict, {module: ΔW in fp64}) with ‖ΔW‖ = ratio·‖W_q‖ per layer (alpha = rank: γ = 1)."""
    g = torch.Generator().manual_seed(seed)
    sd, deltas = {}, {}
    for name, m in layers.items():
        w = dequantized(m.weight.detach()).double()
        down = torch.randn(rank, m.in_features, generator=g) / m.in_features**0.5
        up = torch.randn(m.out_features, rank, generator=g)
        delta = up.double() @ down.double()
        up = up * float(ratio * w.norm() / delta.norm())
        stem = "lora_unet_" + name.replace(".", "_")
        sd |= {
            f"{stem}.lora_down.weight": down,
            f"{stem}.lora_up.weight": up,
            f"{stem}.alpha": torch.tensor(float(rank)),
        }
        deltas[name] = STRENGTH * up.double() @ down.double()
    return sd, deltas


def rho(applied: torch.Tensor, intended: torch.Tensor) -> tuple[float, float]:
    applied, intended = applied.detach().double(), intended.detach().double()
    r = float((applied * intended).sum() / intended.square().sum())
    return r, float((applied - intended).norm() / intended.norm())


def loaded_weights(c, model, layers: dict) -> dict[str, torch.Tensor]:
    """Each layer's weight dequantized while `model` is loaded (ComfyUI's merge applied), then unloaded."""
    with torch.no_grad():  # as ComfyUI loads (its prompts run under inference mode)
        c.model_management.load_models_gpu([model])
    try:
        return {n: dequantized(m.weight).double() for n, m in layers.items()}
    finally:
        c.model_management.unload_all_models()
        model.detach(unpatch_all=True)


def runtime_rho(c, model, layers: dict, deltas: dict, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed + 1)
    xs = {n: torch.randn(64, m.in_features, generator=g) for n, m in layers.items()}
    with torch.no_grad():
        base = {n: layers[n](x).double() for n, x in xs.items()}
        c.model_management.load_models_gpu([model])
        try:
            ours = {n: layers[n](x).double() for n, x in xs.items()}
        finally:
            c.model_management.unload_all_models()
            model.detach(unpatch_all=True)
    return [rho(ours[n] - base[n], xs[n].double() @ deltas[n].T)[0] for n in layers]


def nearest_rho(layers: dict, base: dict, deltas: dict) -> list[float]:
    """ρ of W + ΔW requantized by each layer's own layout with round-to-nearest (stochastic rounding off)."""
    out = []
    for name, m in layers.items():
        merged = (base[name] + deltas[name]).to(torch.float32)
        if is_quantized_tensor(m.weight):
            again = m.weight.requantize_from_float(merged, scale="recalculate", stochastic_rounding=0)
        else:  # a plain float8 weight: ComfyUI's rounding without the stochastic part
            again = merged.to(m.weight.dtype)
        out.append(rho(dequantized(again).double() - base[name], deltas[name])[0])
    return out


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f})"


def measure(fmt: str, folder: Path, hidden: int, ratios: list[float], rank: int, seed: int) -> list[str]:
    c = import_comfy()
    path = folder / f"{fmt}.safetensors"
    save_file(flux_sd(fmt, seed, hidden_size=hidden, num_heads=hidden // 128), str(path))
    patcher = load_flux(path, fmt)
    layers = quantized_linears(patcher)
    base = {n: dequantized(m.weight).double() for n, m in layers.items()}
    rows = []
    for ratio in ratios:
        sd, deltas = lora_file(layers, ratio, rank, seed)
        core, _ = c.sd.load_lora_for_models(patcher, None, sd, STRENGTH, 0.0)
        core_after = loaded_weights(c, core, layers)
        core_rho = [rho(core_after[n] - base[n], deltas[n]) for n in layers]
        merged, _, report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0, mode="merge")
        reported = [r["retention"] for r in report.to_dict()["applied"]]
        merged_after = loaded_weights(c, merged, layers)
        merged_rho = [rho(merged_after[n] - base[n], deltas[n])[0] for n in layers]
        auto, _, auto_report = load_lora_for_models(patcher, None, sd, STRENGTH, 0.0)
        assert auto_report.mode == "runtime", auto_report.summary()
        core_r, core_e = summary([r for r, _ in core_rho]), summary([e for _, e in core_rho])
        rows.append(
            f"| {fmt} | {ratio:g} | {core_r} | {core_e} "
            f"| {summary(nearest_rho(layers, base, deltas))} | {summary(reported)} | {summary(merged_rho)} "
            f"| {summary(runtime_rho(c, auto, layers, deltas, seed))} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ratios", default="0.01,0.03,0.1")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", default="", help="comma-separated subset of the tree's formats")
    args = parser.parse_args()
    chosen = [f for f in formats() if not args.formats or f in args.formats.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    from importlib.metadata import version

    print(
        f"ComfyUI {COMFYUI_TREE}, comfy-kitchen {version('comfy-kitchen')} (eager CPU), "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"Flux hidden {args.hidden}, LoRA rank {args.rank}, strength {STRENGTH}\n"
    )
    print(
        "| format (layout) | ‖ΔW‖/‖W‖ | core LoraLoader ρ | core ε | round-to-nearest ρ "
        "| ours merge ρ (report) | ours merge ρ (loaded) | ours auto (runtime) ρ |"
    )
    print("|---|---|---|---|---|---|---|---|")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        for fmt in chosen:
            for row in measure(fmt, Path(folder), args.hidden, ratios, args.rank, args.seed):
                print(row.replace(f"| {fmt} |", f"| {fmt} ({layout_of(fmt)}) |", 1), flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
