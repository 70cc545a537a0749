"""`loraweave generate` argument parsing and printing (the library side is `loraweave.tools.generate`)."""

from __future__ import annotations

import argparse
import json
import sys

from ..arguments import MAX_CFG, MAX_SIDE, MAX_STEPS, SEED_RANGE
from ..errors import StrictApplyError
from .support import (
    adapter_arg,
    add_common,
    cli_words,
    integer_arg,
    limit_arg,
    modality_arg,
    number_arg,
    print_json_error,
)


def run(args: argparse.Namespace) -> int:
    from ..tools.generate import GenerateRequest, generate

    req = GenerateRequest(
        model=args.model,
        prompt=args.prompt,
        output=args.output,
        negative=args.negative,
        lora_dir=args.lora_dir,
        loras=args.lora,
        modality_strengths=dict(args.modality) or None,
        apply_mode=args.lora_apply_mode,
        quantize=args.quantize,
        budget=args.budget,
        steps=args.steps,
        cfg=args.cfg,
        seed=args.seed,
        width=args.width,
        height=args.height,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        arch=args.arch,
        config=args.config,
        strict=args.strict,
        progress=not args.json and not args.quiet and sys.stderr.isatty(),
        overwrite=args.force,
        allow_empty=args.allow_empty,
        allow_other_arch=args.allow_other_arch,
    )
    try:
        res = generate(req)
    except StrictApplyError as exc:  # completed the check, refused to sample: exit 1, nothing written
        print(f"loraweave: {cli_words(str(exc))}; nothing written", file=sys.stderr)
        for u in exc.report.unmatched[: args.limit]:
            print(f"  not applied: {u['key']}: {u['reason']}", file=sys.stderr)
        if args.json:
            unmatched = [{"key": u["key"], "reason": u["reason"]} for u in exc.report.unmatched]
            print_json_error(args, f"{cli_words(str(exc))}; nothing written", 1, unmatched=unmatched)
        return 1
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    rep = res.report
    landed = (
        f"{rep['keys_applied']}/{rep['keys_total']} adapter keys landed ({rep['mode']})"
        if rep
        else "no adapter"
    )
    print(
        f"wrote {res.output} (seed {res.seed}, {landed}{quantized(args.quantize, res.quantized_layers)}; "
        f"sidecar {res.sidecar}) in {sum(res.seconds.values()):.2f}s"
    )
    for other in rep["other_arch"] if rep else []:
        print(
            f"loraweave: warning: {other['adapter']}: {other['words']}, applied anyway (--allow-other-arch)",
            file=sys.stderr,
        )
    if rep and rep["unmatched"]:
        print(
            f"loraweave: warning: {len(rep['unmatched'])} keys did not land: {rep['unmatched_by_kind']}",
            file=sys.stderr,
        )
    return 0


def quantized(kind: str | None, layers: int | None) -> str:
    """The summary line's word on --quantize: how many layers, or that none was (the model ran in float)."""
    if kind is None:
        return ""
    if not layers:
        return f"; {kind}: no layer quantized (SDNQ leaves layers under 16384 weights in float)"
    return f"; {kind}: {layers} layers quantized"


def add(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="prompt with <lora:name:w> tags -> image (stable-diffusion.cpp style)",
        description="Generate one image with a diffusers pipeline. `<lora:NAME:W[:TE]>` tags in the prompt "
        "name .safetensors files in --lora-dir (by stem or relative path) and are stripped before encoding; "
        "--lora adds files directly. Adapters are applied by loraweave (every key lands or is reported). The "
        "PNG gets a `parameters` text chunk as A1111 writes it (prompt with its tags, Negative prompt, "
        "Steps, Sampler, CFG scale, Seed, Size, Model hash, Model, Lora hashes, Loraweave summary, Version), "
        "a `loraweave` chunk with the full report (JSON), and OUT.json beside it with the request, report "
        "and timings.",
        epilog="for generate: 0 = image written; 1 = --strict and some adapter key does not land, or an "
        "adapter lands no key without --allow-empty (nothing written); 2 = bad arguments, an adapter for "
        "another architecture than the model's without --allow-other-arch, a missing or "
        "unreadable model or adapter, an unknown <lora:> name, or an existing output without --force.",
    )
    p.add_argument(
        "--model",
        "-m",
        required=True,
        help="diffusers pipeline folder, or a single-file checkpoint with --arch (and --config offline)",
    )
    p.add_argument(
        "-p", "--prompt", required=True, help="prompt; may hold <lora:NAME:W[:TE]> / <lyco:...> tags"
    )
    p.add_argument("-n", "--negative", default="", help="negative prompt (default: none)")
    p.add_argument(
        "--lora-dir",
        "--lora-model-dir",
        dest="lora_dir",
        help="folder the prompt's <lora:NAME> tags are looked up in (recursively)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        type=adapter_arg,
        metavar="FILE[:S]",
        help="adapter file with an optional strength (default 1.0); repeatable",
    )
    p.add_argument(
        "--modality",
        action="append",
        default=[],
        type=modality_arg,
        metavar="NAME=S",
        help="per-modality strength of audio-video models (LTX-2/2.3, MiniMax-H3): NAME video, audio or "
        "cross (cross-modal and joint modules), e.g. --modality audio=0; repeatable; applies to every "
        "adapter whose <lora:> tag sets none (tag items video=/audio=/cross=); refused on a model "
        "without modalities",
    )
    p.add_argument(
        "--lora-apply-mode",
        choices=["auto", "merge", "runtime"],
        default="auto",
        help="merge into the weights, add at runtime, or auto (runtime where merging is lossy: "
        "quantized or streamed layers)",
    )
    p.add_argument(
        "--quantize", choices=["sdnq-int8", "sdnq-uint4"], help="quantize the denoiser with SDNQ first"
    )
    p.add_argument(
        "--budget",
        help="stream the denoiser's blocks under this device memory budget: 'auto' or a "
        "size (512M, 4G); adapters follow their layers",
    )
    p.add_argument(
        "--steps", type=integer_arg("--steps", 1, MAX_STEPS), default=20, help="sampling steps (default 20)"
    )
    p.add_argument(
        "--cfg",
        "--cfg-scale",
        dest="cfg",
        type=number_arg("--cfg", 0, MAX_CFG),
        default=7.0,
        help="guidance scale (default 7.0)",
    )
    p.add_argument(
        "-s",
        "--seed",
        type=integer_arg("-s/--seed", *SEED_RANGE),
        default=42,
        help="seed (default 42; < 0: random)",
    )
    for short, side in (("-W", "width"), ("-H", "height")):
        p.add_argument(
            short,
            f"--{side}",
            type=integer_arg(f"{short}/--{side}", 8, MAX_SIDE),
            default=512,
            help=f"{side} in pixels, a multiple of 8 (default 512)",
        )
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument(
        "--threads",
        type=integer_arg("--threads", 1, 1024),
        help="torch threads (default: torch's; CPU kernels round by thread count: give serve's --threads "
        "to get its image bit for bit)",
    )
    p.add_argument(
        "--dtype", choices=["fp32", "fp16", "bf16"], default="fp32", help="weights dtype (default fp32)"
    )
    p.add_argument(
        "--arch",
        help="architecture of a single-file --model (sd1, sd2, sdxl, sd3, flux, "
        "flux-schnell, chroma, z-image, qwen-image)",
    )
    p.add_argument(
        "--config", help="with a single-file --model: local diffusers folder with the pipeline configs"
    )
    p.add_argument(
        "-o", "--output", default="output.png", help="output PNG (default output.png); OUT.json beside it"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output PNG and its OUT.json (never an input)",
    )
    p.add_argument(
        "--strict", action="store_true", help="refuse (exit 1, nothing written) unless every key lands"
    )
    p.add_argument(
        "--json", action="store_true", help="print the result (paths, seed, report, timings) as JSON"
    )
    p.add_argument(
        "--limit", type=limit_arg, default=20, help="keys not applied to list under --strict (default 20)"
    )
    p.add_argument(
        "--allow-other-arch",
        action="store_true",
        help="apply an adapter whose keys and shapes say it is for another architecture than the model's "
        "(default: refuse, exit 2); the output and a warning say so",
    )
    add_common(p, empty=True)
