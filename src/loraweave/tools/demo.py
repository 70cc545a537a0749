"""The embedded demo: a small seeded Z-Image transformer, a sample LoRA in two layouts, three modes; and
`generate_demo`, `loraweave generate` end to end on a tiny SD1.5 pipeline built here, offline."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import torch

from ..api import apply
from ..io.write import save_file

SAMPLE_FILES = {"peft": "demo_lora_peft.safetensors", "kohya": "demo_lora_kohya.safetensors"}  # in --out
# What `demo --generate` writes in its folder (--out DIR): the pipeline folder and the sample LoRA.
GENERATE_PIPELINE, GENERATE_LORA = Path("pipeline"), Path("loras") / "demo.safetensors"
RANK = 8
ALPHA = 4.0


def build_model(seed: int = 0) -> torch.nn.Module:
    try:
        from diffusers import ZImageTransformer2DModel
    except ImportError as exc:  # diffusers is an optional extra
        raise SystemExit("the demo needs diffusers: pip install 'loraweave[diffusers]'") from exc
    torch.manual_seed(seed)
    # a type checker reads diffusers' __init__ through its placeholder classes (no torch methods)
    return ZImageTransformer2DModel(  # type: ignore[attr-defined]
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=256,
        n_layers=4,
        n_refiner_layers=1,
        n_heads=4,
        n_kv_heads=4,
        cap_feat_dim=64,
        axes_dims=[16, 24, 24],
        axes_lens=[256, 64, 64],
    ).eval()


def forward(model: torch.nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(4, 1, 32, 32, generator=g)]
    cap = [torch.randn(16, 64, generator=g)]
    with torch.no_grad():
        return model(x, torch.tensor([0.5]), cap, return_dict=False)[0][0]


def write_sample_loras(model: torch.nn.Module, out_dir: Path, seed: int = 7) -> dict[str, Path]:
    """One random LoRA on every transformer-layer linear, saved in PEFT layout and in kohya layout.

    The kohya file uses the original checkpoint names, so q/k/v travel as one fused `attention.qkv` key."""
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
            down = torch.randn(RANK, module.in_features, generator=g) / module.in_features**0.5
            up = torch.randn(module.out_features, RANK, generator=g) * 0.05
            factors[name] = (down, up)
    peft = {}
    for name, (down, up) in factors.items():
        peft[f"transformer.{name}.lora_A.weight"] = down
        peft[f"transformer.{name}.lora_B.weight"] = up
    meta = {"lora_adapter_metadata": json.dumps({"transformer.r": RANK, "transformer.lora_alpha": ALPHA})}
    kohya = {}
    for name, (down, up) in factors.items():
        if name.endswith((".to_k", ".to_v")):
            continue
        if name.endswith(".to_q"):
            stem = name[: -len(".to_q")]
            # Fused q|k|v: stacked downs (rank 3r) and a block-diagonal up; alpha scaled to keep alpha/rank.
            downs = [factors[f"{stem}.{p}"][0] for p in ("to_q", "to_k", "to_v")]
            ups = [factors[f"{stem}.{p}"][1] for p in ("to_q", "to_k", "to_v")]
            down, up, alpha, name = torch.cat(downs), torch.block_diag(*ups), ALPHA * 3, f"{stem}.qkv"
        else:
            alpha = ALPHA
            name = name.replace("attention.to_out.0", "attention.out")
        key = "lora_unet_" + name.replace(".", "_")
        kohya[f"{key}.lora_down.weight"] = down.contiguous()
        kohya[f"{key}.lora_up.weight"] = up.contiguous()
        kohya[f"{key}.alpha"] = torch.tensor(alpha)
    out_dir.mkdir(exist_ok=True)  # the CLI checked that its parent exists
    paths = {layout: out_dir / name for layout, name in SAMPLE_FILES.items()}
    save_file(peft, paths["peft"], metadata=meta)  # atomic, mode under the umask
    save_file(kohya, paths["kohya"], metadata={"ss_network_dim": str(RANK), "ss_network_alpha": str(ALPHA)})
    return paths


def run_demo(out_dir: Path) -> dict:
    """Run the demo and return its results (the CLI prints them)."""
    t0 = time.perf_counter()
    model = build_model()
    build_s = time.perf_counter() - t0
    paths = write_sample_loras(model, out_dir)
    base_out = forward(model)
    results: dict = {"files": {k: str(v) for k, v in paths.items()}, "build_seconds": build_s, "runs": {}}
    outputs = {}
    for layout, path in paths.items():
        for mode in ("merge", "runtime", "auto"):
            m = copy.deepcopy(model)
            t = time.perf_counter()
            handle = apply(m, path, mode=mode)
            apply_s = time.perf_counter() - t
            t = time.perf_counter()
            out = forward(m)
            forward_s = time.perf_counter() - t
            handle.remove()
            restored = all(
                torch.equal(a, b)
                for a, b in zip(m.state_dict().values(), model.state_dict().values(), strict=True)
            )
            outputs[(layout, mode)] = out
            results["runs"][f"{layout}/{mode}"] = {
                "summary": handle.report.summary(),
                "apply_seconds": apply_s,
                "forward_seconds": forward_s,
                "restored_bit_exact": restored,
                "report": handle.report.to_dict() if mode == "auto" and layout == "kohya" else None,
            }
    ref = outputs[("peft", "merge")]
    scale = float(ref.abs().max())
    results["max_abs_diff_runtime_vs_merge"] = float((outputs[("peft", "runtime")] - ref).abs().max())
    results["max_abs_diff_kohya_vs_peft"] = float((outputs[("kohya", "merge")] - ref).abs().max())
    results["lora_effect_max_abs"] = float((ref - base_out).abs().max())
    results["output_scale"] = scale
    results["total_seconds"] = time.perf_counter() - t0
    return results


DEMO_PROMPT = "a cat <lora:demo:1>"


def generate_demo(png: Path, work: Path, overwrite: bool = False, progress: bool = False) -> dict:
    """Build the tiny SD1.5 pipeline (tools.tiny_pipeline: offline tokenizer, seeded weights) and a sample
    LoRA under `work`, then run `generate` with a prompt tag to write `png` (and its JSON sidecar).

    `overwrite`: replace an existing PNG and sidecar (the CLI has checked `work`'s files before calling);
    `progress`: diffusers' and transformers' loading and saving bars (off when stderr is not a terminal)."""
    from .generate import GenerateRequest, check_outputs, check_png, generate, loading_bars
    from .tiny_pipeline import sample_lora, tiny_sd15

    check_png(png)
    request = GenerateRequest(
        model=str(work / GENERATE_PIPELINE),
        prompt=DEMO_PROMPT,
        output=str(png),
        negative="blurry",
        lora_dir=str((work / GENERATE_LORA).parent),
        steps=8,
        cfg=5.0,
        seed=7,
        width=64,
        height=64,
        progress=progress,
        overwrite=overwrite,
    )
    check_outputs(request)  # an existing PNG or sidecar is refused before anything is built
    from diffusers import StableDiffusionPipeline

    t0 = time.perf_counter()
    work.mkdir(exist_ok=True)  # the CLI checked that its parent exists
    with loading_bars(progress):
        pipe_dir = tiny_sd15(work / GENERATE_PIPELINE)
        lora = sample_lora(
            StableDiffusionPipeline.from_pretrained(pipe_dir, local_files_only=True), work / GENERATE_LORA
        )
    build_s = time.perf_counter() - t0
    result = generate(request)
    return {
        "pipeline": str(pipe_dir),
        "lora": str(lora),
        "build_seconds": build_s,
        "total_seconds": time.perf_counter() - t0,
        **result.to_dict(),
    }
