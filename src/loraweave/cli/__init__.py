"""Command line: `loraweave demo | inspect | bake | convert | extract | resize | generate` (the only place that
prints).

Every command shares one exit-code table (EXIT_STATUS, printed in each --help and in the README)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from .generate import add_generate
from .serve import add_serve
from .support import (
    add_common,
    configure_logging,
    energy_arg,
    exit_code,
    limit_arg,
    non_negative_arg,
    progress_wanted,
    rank_arg,
    with_exit_status,
)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.out:
        res = run_demo(Path(args.out))
    else:  # sample files live only for the run: nothing is left behind in the temp folder
        with tempfile.TemporaryDirectory(prefix="loraweave-demo-") as tmp:
            res = run_demo(Path(tmp))
        res["files"] = {k: f"{v} (temporary, removed; --out DIR keeps them)" for k, v in res["files"].items()}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(
        f"model: Z-Image transformer (diffusers ZImageTransformer2DModel, seeded), built in {res['build_seconds']:.2f}s"
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
    report = res["runs"]["kohya/auto"]["report"]
    print()
    print("report (kohya file, auto):")
    print(
        f"  adapters: {json.dumps(report['adapters'][0]['families'])} layout={report['adapters'][0]['layout']} "
        f"alpha_sources={report['adapters'][0]['alpha_sources']}"
    )
    print(f"  per component/mechanism: {report['counts']}")
    print(
        f"  keys applied {report['keys_applied']}/{report['keys_total']}, unmatched {len(report['unmatched'])}"
    )
    print()
    print(
        f"largest |runtime - merged| output difference: {res['max_abs_diff_runtime_vs_merge']:.3e} "
        f"(output scale {res['output_scale']:.3f}, LoRA effect {res['lora_effect_max_abs']:.3e})"
    )
    print(f"largest |kohya fused-qkv file - PEFT file| (merged): {res['max_abs_diff_kohya_vs_peft']:.3e}")
    print(f"total {res['total_seconds']:.2f}s")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    if Path(args.file).is_dir() and not (Path(args.file) / "adapter_config.json").is_file():
        from .pictures import inspect_folder

        return inspect_folder(args)
    from ..tools.inspect import format_table, inspect_adapter

    if args.strict and args.no_coverage:
        print("loraweave inspect: --strict needs coverage; drop --no-coverage", file=sys.stderr)
        return 2
    info = inspect_adapter(
        args.file,
        arch=args.arch,
        model=args.model,
        allow_pickle=args.allow_pickle,
        text_encoders=not args.no_text_encoders,
        check_values=args.check_values,
        coverage=not args.no_coverage,
    )
    if args.plot:
        from .pictures import plot_into

        info["plot"] = plot_into(args)
    print(json.dumps(info, indent=2) if args.json else format_table(info, args.limit))
    cov = info["coverage"]
    return 1 if args.strict and (cov["complete"] is False or cov["keys_total"] == 0) else 0


def _add_inspect(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="what an adapter file is and how much of it lands on a model",
        description="Show an adapter's layout, families, ranks, alphas (and where they come from), dtypes, "
        "metadata and detected architecture with its evidence, then resolve every key against the architecture "
        "(full size on the meta device: no weights, no download) or a checkpoint, listing unmatched keys and why.",
        epilog="JSON (--json) always has layout, families, architecture {name, evidence}, "
        "coverage {keys_total, keys_applied, unmatched}.",
    )
    p.add_argument(
        "file", help=".safetensors adapter file, PEFT directory, or a folder of adapters (one row each)"
    )
    p.add_argument("--plot", metavar="OUT.png", help="also draw a heatmap of ‖ΔW‖ per block × module kind")
    p.add_argument(
        "--metric",
        choices=["norm", "energy"],
        default="norm",
        help="--plot cell value: ‖ΔW‖_F (default) or share of the total Σ‖ΔW‖²",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--arch",
        help="resolve against this architecture instead of the detected one "
        "(sd1, sd2, sdxl, sdxl-refiner, flux, flux-schnell, chroma, flux2, sd3, z-image, qwen-image, "
        "wan, hunyuan-video, krea2)",
    )
    where.add_argument(
        "--model",
        help="resolve against a checkpoint: .safetensors file, diffusers component "
        "folder (sharded or not) or pipeline folder; only tensor headers are read",
    )
    p.add_argument("--no-text-encoders", action="store_true", help="with --arch: skip the text encoders")
    p.add_argument(
        "--check-values",
        action="store_true",
        help="also read every factor and reject NaN/Inf (default: names and shapes only, alphas read)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--no-coverage",
        action="store_true",
        help="describe the file alone: no model is built and "
        "no key resolved (fast: torch is not imported; a UNet file is not told apart as sd1/sd2/sdxl, which takes "
        "fitting); JSON coverage has checked=false",
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when coverage is incomplete (or the file is empty)"
    )
    p.add_argument(
        "--limit", type=limit_arg, default=20, help="unmatched keys listed in the table (default 20)"
    )
    add_common(p, pickle=True)
    p.set_defaults(func=_cmd_inspect)


def _cmd_bake(args: argparse.Namespace) -> int:
    from ..tools.bake import bake, parse_adapter_arg

    res = bake(
        args.model,
        [parse_adapter_arg(a) for a in args.lora],
        args.output,
        dtype=args.dtype,
        strict=args.strict,
        overwrite=args.force,
        progress=progress_wanted(args),
        allow_empty=args.allow_empty,
        allow_pickle=args.allow_pickle,
    )
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    print(
        f"baked {len(res.adapters)} adapter(s) into {res.output}: {res.tensors_changed} of {res.tensors} tensors "
        f"changed, {res.keys_applied}/{res.keys_total} keys applied, {res.bytes_written / 2**20:.1f} MiB written "
        f"in {res.seconds:.2f}s"
    )
    for u in res.unmatched[: args.limit]:
        print(f"  not applied: {u['key']}: {u['reason']}")
    if len(res.unmatched) > args.limit:
        print(f"  ... {len(res.unmatched) - args.limit} more not applied (--json lists all)")
    return 0


def _print_lowrank(res, args: argparse.Namespace, verb: str) -> int:
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    ranks = sorted({la["rank"] for la in res.layers})
    print(
        f"{verb} {len(res.layers)} layers into {res.output} (ranks {ranks[0] if ranks else '-'}..."
        f"{ranks[-1] if ranks else '-'}) in {res.seconds:.2f}s"
    )
    if res.layers:
        print(f"captured energy per layer: min {res.energy_min:.6f}, median {res.energy_median:.6f}")
        worst = sorted(res.layers, key=lambda la: la["energy"])[: args.limit]
        for la in worst:
            print(f"  {la['energy']:.6f}  rank {la['rank']:>4}  {la['name']}")
    for reason, n in res.skipped.items():
        print(f"skipped {n}: {reason}")
    return 0


def _cmd_extract(args: argparse.Namespace) -> int:
    from ..tools.extract import extract

    res = extract(
        args.base,
        args.tuned,
        args.output,
        rank=args.rank,
        energy=args.energy,
        dtype=args.dtype,
        min_rel_diff=args.min_diff,
        overwrite=args.force,
        allow_empty=args.allow_empty,
        progress=progress_wanted(args),
    )
    return _print_lowrank(res, args, "extracted")


def _cmd_resize(args: argparse.Namespace) -> int:
    from ..tools.extract import resize

    res = resize(
        args.file,
        args.output,
        rank=args.rank,
        energy=args.energy,
        dtype=args.dtype,
        overwrite=args.force,
        arch=args.arch,
        model=args.model,
        allow_empty=args.allow_empty,
        progress=progress_wanted(args),
        allow_pickle=args.allow_pickle,
    )
    return _print_lowrank(res, args, "resized")


def _lowrank_options(p: argparse.ArgumentParser, pickle: bool) -> None:
    p.add_argument("-o", "--output", required=True, help="output .safetensors file (written atomically)")
    p.add_argument(
        "--rank", type=rank_arg, help="rank per layer, an integer >= 1 (the cap when --energy is also given)"
    )
    p.add_argument(
        "--energy",
        type=energy_arg,
        help="per layer, the smallest rank keeping this share of Σσ², in (0, 1] (e.g. 0.99)",
    )
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="factor dtype (default: the input's)")
    p.add_argument("--force", action="store_true", help="replace an existing output (never an input)")
    p.add_argument("--json", action="store_true", help="print per-layer ranks and energies as JSON")
    p.add_argument("--limit", type=limit_arg, default=10, help="lowest-energy layers to list (default 10)")
    add_common(p, pickle=pickle, empty=True)


def _add_lowrank(sub) -> None:
    p = sub.add_parser(
        "extract",
        help="LoRA from the difference of two checkpoints",
        description="Extract a LoRA from TUNED - BASE, layer by layer (one difference in memory at a time): each "
        "weight's ΔW is truncated by SVD to --rank, or to the smallest rank keeping --energy of its energy Σσ². "
        "Reports the captured energy per layer (min / median); 1-D differences (norms, biases) are counted, not "
        "written. Output keys use the checkpoint's own module names: diffusers-named weights in diffusers' layout "
        "(unet./transformer./text_encoder. + lora_A/lora_B, which its loader reads), original (ldm/BFL) names in "
        "ComfyUI's (diffusion_model. + lora_down/lora_up, alpha = rank); scale 1 either way.",
    )
    p.add_argument("base", help="base checkpoint (.safetensors file, component or pipeline folder)")
    p.add_argument("tuned", help="fine-tuned checkpoint with the same tensor names")
    p.add_argument(
        "--min-diff",
        type=non_negative_arg,
        default=0.0,
        help="skip layers whose |ΔW|/|W| is below this (>= 0)",
    )
    _lowrank_options(p, pickle=False)
    p.set_defaults(func=_cmd_extract)
    p = sub.add_parser(
        "resize",
        help="re-rank an adapter: LoRA/LoHa/LoKr/full -> LoRA of rank R",
        description="Rewrite every LoRA, LoHa, LoKr or full-diff part of an adapter as a LoRA of rank --rank (or "
        "the smallest rank keeping --energy of Σσ²), with its alpha/rank scale folded in and alpha = rank. LoRA "
        "parts are truncated through QR of the factors (ΔW is never formed); the others one ΔW at a time. Reports "
        "captured energy per layer; families that need the base weight (OFT, DoRA, IA3, GLoRA) are refused. "
        "Positional (cloneofsimo) files are named on the architecture they fit (or --arch) and written in the "
        "diffusers layout.",
    )
    p.add_argument("file", help="adapter .safetensors file or PEFT folder")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--arch",
        help="architecture that gives conv kernel shapes flat-stored factors lack (default: detected)",
    )
    where.add_argument("--model", help="checkpoint that gives those shapes instead")
    _lowrank_options(p, pickle=True)
    p.set_defaults(func=_cmd_resize)


def _cmd_convert(args: argparse.Namespace) -> int:
    from ..tools.convert import convert

    res = convert(
        args.file,
        args.to,
        args.output,
        arch=args.arch,
        model=args.model,
        overwrite=args.force,
        allow_empty=args.allow_empty,
        progress=progress_wanted(args),
        allow_pickle=args.allow_pickle,
    )
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    print(
        f"converted {res.keys_in} keys to {res.layout} layout: {res.keys_out} keys on {res.targets} targets "
        f"({res.splits} split, {res.joins} joined) -> {res.output}"
    )
    for note in res.notes:
        print(f"note: {note}")
    return 0


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="rewrite a LoRA in another trainer layout (kohya, peft, diffusers, comfy)",
        description="Convert a LoRA between layouts: kohya (lora_unet_/lora_te_, underscored; original names for "
        "SDXL and DiTs), peft (folder: adapter_model.safetensors + adapter_config.json), diffusers (component-"
        "prefixed lora_A/lora_B, alpha in lora_adapter_metadata), comfy (diffusion_model.<original names>). Keys "
        "are resolved against the model (full size on the meta device, from --arch or detection, or --model), so "
        "fused rows are split (shared down, up rows cut) or joined (shared down when equal, else rank "
        "concatenation) exactly as the target naming needs; alpha is carried so alpha/rank is unchanged. The "
        "result is re-resolved before writing. Other families, and keys that do not resolve, are refused.",
    )
    p.add_argument("file", help="adapter .safetensors file or PEFT folder")
    p.add_argument(
        "--to", required=True, choices=["kohya", "peft", "diffusers", "comfy"], help="target layout"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--arch", help="architecture whose module names and fused rows apply (default: detected)"
    )
    where.add_argument("--model", help="checkpoint (file or folder) to resolve against instead")
    p.add_argument("-o", "--output", required=True, help="output file (peft: output folder)")
    p.add_argument("--force", action="store_true", help="replace an existing output (never an input)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_common(p, pickle=True, empty=True)
    p.set_defaults(func=_cmd_convert)


def _add_tools(sub) -> None:
    p = sub.add_parser(
        "bake",
        help="merge adapters into a checkpoint on disk (tensor by tensor)",
        description="Merge LoRA/LyCORIS adapters into a checkpoint: a single .safetensors file, a (sharded) diffusers "
        "component folder with its index, or a diffusers pipeline folder. Keys resolve against the checkpoint's own "
        "tensor names (no model is built); each tensor is read, merged (fp32 accumulation, one rounding, identical "
        "to apply(mode='merge')) and written alone, so memory stays near the largest tensor. The output is written "
        "to a temp path next to the target and renamed into place only when complete; it may not overwrite an input. "
        "Every output file's metadata records the adapters, their sha256, strengths and the tool version. "
        "Strengths follow AdapterSpec's rule: finite, |s| <= 1e4. Positional (cloneofsimo) files are named on the "
        "architecture they fit, by the resolver apply uses.",
    )
    p.add_argument("model", help="checkpoint: .safetensors file, component folder or pipeline folder")
    p.add_argument(
        "lora", nargs="+", help="adapter file, optionally with a strength: FILE[:STRENGTH] (default 1.0)"
    )
    p.add_argument("-o", "--output", required=True, help="output file (single-file input) or folder")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="cast floating tensors of the output")
    p.add_argument("--strict", action="store_true", help="write nothing unless every key lands (else exit 1)")
    p.add_argument("--force", action="store_true", help="replace an existing output (never an input)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--limit", type=limit_arg, default=20, help="keys not applied to list (default 20)")
    add_common(p, pickle=True, empty=True)
    p.set_defaults(func=_cmd_bake)
    _add_convert(sub)
    _add_lowrank(sub)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="loraweave",
        description="Apply LoRA/LyCORIS adapters to diffusion models: every key lands or is reported.",
    )
    parser.add_argument("--version", action="version", version=f"loraweave {__version__}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log key=value summaries at INFO (and the optional quantization packages' own warnings)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded demo (small seeded Z-Image model, sample LoRAs)")
    demo.add_argument(
        "--out", help="directory for the sample LoRA files (default: a temp directory, removed at the end)"
    )
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.set_defaults(func=_cmd_demo)
    _add_inspect(sub)
    _add_tools(sub)
    add_generate(sub)
    add_serve(sub)
    with_exit_status(parser, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    restore = configure_logging(args.verbose)
    try:
        return args.func(args)
    except SystemExit:
        raise
    except BaseException as exc:  # every failure: one line (a traceback only for bugs), the table's code
        code, message = exit_code(exc, args)
        print(f"loraweave: error: {message}", file=sys.stderr)
        return code
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
