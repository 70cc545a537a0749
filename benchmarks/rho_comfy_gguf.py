"""ΔW retention ρ = ⟨ΔW_applied, ΔW⟩/‖ΔW‖² of a LoRA on a GGUF Flux in ComfyUI, per quant type: core's
LoraLoader on ComfyUI-GGUF (patches applied by GGMLOps at forward), loraweave (auto = runtime), each in fp32
and bf16 compute; and what a merge into the quantized grid would keep (dequantize, add ΔW, requantize to the
same type: what stable-diffusion.cpp does on a quantized model, sd.cpp #904).

ΔW_applied is read from the layer's output on the identity input (biases written as zero), so it is what the
forward carries. The layer: `double_blocks.0.img_mlp.0` of the tiny Flux (hidden 256 -> 1024) written in each
type; the LoRA: rank 16 on it, ‖ΔW‖/‖W‖ = `--rel` (default 0.05) and a smaller one. Requantize row: a
3072 x 3072 weight (Flux's width) at the same relative ΔW, gguf's numpy quantizer (Q8_0, Q4_0, Q5_0) or the
tests' min/max K-quant packer (Q4_K, Q5_K; llama.cpp's own search would round differently).

    .venv/bin/python benchmarks/rho_comfy_gguf.py [--rel 0.05 0.01]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LAYER = "double_blocks.0.img_mlp.0"
TYPES = ("F16", "Q8_0", "Q5_K", "Q4_K", "Q4_0")
RANK = 16


def rho(applied: torch.Tensor, intended: torch.Tensor) -> float:
    a, d = applied.double(), intended.double()
    return float((a * d).sum() / (d * d).sum())


def lora(w: torch.Tensor, rel: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(down, up, ΔW = up @ down) with ‖ΔW‖ = rel·‖W‖."""
    g = torch.Generator().manual_seed(seed)
    down = torch.randn(RANK, w.shape[1], generator=g)
    up = torch.randn(w.shape[0], RANK, generator=g)
    delta = up @ down
    k = (rel * w.norm() / delta.norm()).sqrt()
    return down * k, up * k, (up * k) @ (down * k)


def applied_delta(model, patched, layer: str, dtype: torch.dtype) -> torch.Tensor:
    from helpers.comfy_env import import_comfy

    c = import_comfy()
    mod = model.model.diffusion_model.get_submodule(layer)
    eye = torch.eye(mod.in_features, dtype=dtype)
    with torch.no_grad():
        base = mod(eye).float()
    c.model_management.load_models_gpu([patched])
    try:
        with torch.no_grad():
            out = mod(eye).float()
    finally:
        c.model_management.unload_all_models()
        patched.detach(unpatch_all=True)
    return (out - base).T


def pack_rows(qtypes, rels) -> list[list[str]]:
    from helpers import comfy_gguf as cg
    from helpers.comfy_env import import_comfy

    from loraweave.comfy import load_lora_for_models

    c = import_comfy()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in qtypes:
            state = cg.flux_state_dict_gguf(0)
            state = {k: (v * 0 if k.endswith(".bias") else v) for k, v in state.items()}
            path = Path(tmp) / f"{qtype}.gguf"
            cg.write_gguf(path, state, "flux", lambda k, s, q=qtype: q if LAYER in k else "F16")
            model = cg.load_gguf(path)
            w = cg.layer_weight(model.model.diffusion_model.get_submodule(LAYER))
            for rel in rels:
                down, up, delta = lora(w, rel, 3)
                stem = f"diffusion_model.{LAYER}"
                sd = {f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up}
                sd[f"{stem}.alpha"] = torch.tensor(float(RANK))
                cells = [qtype, f"{rel:g}"]
                for who in ("core", "ours"):
                    for dtype in (torch.float32, torch.bfloat16):
                        if who == "core":
                            patched, _ = c.sd.load_lora_for_models(model, None, sd, 1.0, 0.0)
                        else:
                            patched, _, _ = load_lora_for_models(model, None, sd, 1.0, 0.0)
                        cells.append(f"{rho(applied_delta(model, patched, LAYER, dtype), delta):.4f}")
                rows.append(cells)
    return rows


def requant_rows(qtypes, rels) -> list[list[str]]:
    from helpers import comfy_gguf as cg

    g = np.random.default_rng(0)
    w = (g.standard_normal((3072, 3072)) * 0.02).astype(np.float32)
    rows = []
    for qtype in qtypes:
        if qtype == "F16":
            continue
        wq = cg.dequantize(cg.quantize(w, qtype), qtype)
        for rel in rels:
            _, _, delta = lora(torch.from_numpy(wq), rel, 3)
            d = delta.numpy()
            merged = cg.dequantize(cg.quantize(wq + d, qtype), qtype)
            r = rho(torch.from_numpy(merged - wq), delta)
            rows.append([qtype, f"{rel:g}", f"{r:.4f}", f"{1 / r:.2f}x" if r > 0 else "inf"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rel", type=float, nargs="+", default=[0.05, 0.01])
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    args = ap.parse_args()
    head = ["type", "‖ΔW‖/‖W‖", "core fp32", "core bf16", "ours fp32", "ours bf16"]
    rows = pack_rows(args.types, args.rel)
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("\n".join("| " + " | ".join(r) + " |" for r in rows))
    head = ["type", "‖ΔW‖/‖W‖", "ρ merge-requantize (3072²)", "strength to make up"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    print("\n".join("| " + " | ".join(r) + " |" for r in requant_rows(args.types, args.rel)))


if __name__ == "__main__":
    main()
