"""`loraweave demo`: run the embedded demo and print its table (the demo itself is `loraweave.tools.demo`)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run the embedded demo (small seeded Z-Image model, sample LoRAs)",
        description="Build a small seeded Z-Image transformer (diffusers' class, random weights: nothing is "
        "downloaded), write one sample LoRA in two layouts (PEFT and kohya with a fused q|k|v), apply each "
        "in merge, runtime and auto mode, and print how long each took, whether removal restored the weights "
        "bit for bit, the report of the kohya file, and how far runtime and merged outputs (and the two "
        "layouts) differ. Takes a minute or two on a CPU.",
    )
    p.add_argument(
        "--out", help="directory for the sample LoRA files (default: a temp directory, removed at the end)"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace the demo's own files already there (--out's sample files, --generate's PNG, sidecar, "
        "pipeline and LoRA); no other file",
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--generate",
        metavar="PNG",
        help="instead: build a tiny SD1.5 pipeline offline (seeded, 64x64) and a sample LoRA, and run "
        "`generate` with <lora:demo:1> to write PNG and its .json sidecar (the pipeline and LoRA go to "
        "--out DIR as DIR/pipeline and DIR/loras/demo.safetensors, else a temp directory; existing ones, "
        "and an existing PNG, are replaced only with --force)",
    )


def run(args: argparse.Namespace) -> int:
    if args.generate:
        return _run_generate(args)
    from ..tools.demo import run_demo  # torch and diffusers load only when the demo runs

    if args.out:
        check_sample_outputs(Path(args.out), args.force)
        res = run_demo(Path(args.out))
    else:  # sample files live only for the run: nothing is left behind in the temp folder
        with tempfile.TemporaryDirectory(prefix="loraweave-demo-") as tmp:
            res = run_demo(Path(tmp))
        res["files"] = {k: f"{v} (temporary, removed; --out DIR keeps them)" for k, v in res["files"].items()}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    _print_runs(res)
    _print_report(res["runs"]["kohya/auto"]["report"])
    _print_differences(res)
    return 0


def check_sample_outputs(out_dir: Path, overwrite: bool) -> None:
    """--out DIR: its parent must exist, and the sample files already in it are kept unless --force."""
    from ..io.output import check_output
    from ..tools.demo import SAMPLE_FILES

    if not out_dir.is_dir():  # a new folder: its parent must exist (a file in its place is refused)
        check_output(out_dir, [], folder=True)
        return
    for name in SAMPLE_FILES.values():
        check_output(out_dir / name, [], overwrite=overwrite)


def _print_runs(res: dict) -> None:
    print(
        f"model: Z-Image transformer (diffusers ZImageTransformer2DModel, seeded), built in "
        f"{res['build_seconds']:.2f}s"
    )
    for layout, path in res["files"].items():
        print(f"sample LoRA ({layout} layout): {path}")
    print()
    print(f"{'file/mode':<16} {'apply s':>8} {'forward s':>9}  restored  summary")
    for name, run in res["runs"].items():
        print(
            f"{name:<16} {run['apply_seconds']:>8.3f} {run['forward_seconds']:>9.3f}  "
            f"{'yes' if run['restored_bit_exact'] else 'NO':<8}  {run['summary']}"
        )


def _print_report(report: dict) -> None:
    print()
    print("report (kohya file, auto):")
    print(
        f"  adapters: {json.dumps(report['adapters'][0]['families'])} "
        f"layout={report['adapters'][0]['layout']} alpha_sources={report['adapters'][0]['alpha_sources']}"
    )
    print(f"  per component/mechanism: {report['counts']}")
    print(
        f"  keys applied {report['keys_applied']}/{report['keys_total']}, unmatched "
        f"{len(report['unmatched'])}"
    )


def _print_differences(res: dict) -> None:
    print()
    print(
        f"largest |runtime - merged| output difference: {res['max_abs_diff_runtime_vs_merge']:.3e} "
        f"(output scale {res['output_scale']:.3f}, LoRA effect {res['lora_effect_max_abs']:.3e})"
    )
    print(f"largest |kohya fused-qkv file - PEFT file| (merged): {res['max_abs_diff_kohya_vs_peft']:.3e}")
    print(f"total {res['total_seconds']:.2f}s")


def check_generate_outputs(png: Path, out_dir: Path | None, overwrite: bool) -> None:
    """--generate PNG [--out DIR]: the PNG, its sidecar and DIR's pipeline folder and sample LoRA, checked
    before anything is built; what exists is replaced only with --force (DIR's other files never)."""
    from ..io.output import check_output
    from ..tools.demo import GENERATE_LORA, GENERATE_PIPELINE
    from ..tools.generate import check_png

    check_png(png)
    for target in (png, png.with_suffix(".json")):
        check_output(target, [], overwrite=overwrite)
    if out_dir is None:
        return
    if not out_dir.is_dir():  # a new folder: its parent must exist (a file in its place is refused)
        check_output(out_dir, [], folder=True)
        return
    for rel, folder in ((GENERATE_PIPELINE, True), (GENERATE_LORA.parent, True), (GENERATE_LORA, False)):
        if (out_dir / rel).exists():  # of the other kind: refused even with --force
            check_output(out_dir / rel, [], overwrite=overwrite or rel == GENERATE_LORA.parent, folder=folder)


def _run_generate(args: argparse.Namespace) -> int:
    png = Path(args.generate)
    check_generate_outputs(png, Path(args.out) if args.out else None, args.force)
    from ..tools.demo import generate_demo

    bars = sys.stderr.isatty() and not args.json  # diffusers' bars only to a terminal
    if args.out:
        res = generate_demo(png, Path(args.out), overwrite=args.force, progress=bars)
    else:  # the pipeline and LoRA live only for the run
        with tempfile.TemporaryDirectory(prefix="loraweave-demo-") as tmp:
            res = generate_demo(png, Path(tmp), overwrite=args.force, progress=bars)
        res["pipeline"] += " (temporary, removed; --out DIR keeps it)"
        res["lora"] += " (temporary, removed)"
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"pipeline: tiny SD1.5 (2-level UNet, 2-layer CLIP, offline tokenizer): {res['pipeline']}")
    print(f"sample LoRA (kohya layout, UNet + text encoder): {res['lora']}")
    print(f"image: {res['output']} (sidecar {res['sidecar']}), {res['total_seconds']:.2f}s")
    print(f"parameters: {res['parameters']}")
    return 0
