"""`loraweave extract`: a LoRA from the difference of two checkpoints (argument handling; the library side
is `loraweave.tools.extract`)."""

from __future__ import annotations

import argparse

from .support import lowrank_options, non_negative_arg, print_lowrank, progress_wanted, refuse_output


def add(sub) -> None:
    p = sub.add_parser(
        "extract",
        help="LoRA from the difference of two checkpoints",
        description="Extract a LoRA from TUNED - BASE, layer by layer (one difference in memory at a time): "
        "each weight's ΔW is truncated by SVD to --rank, or to the smallest rank keeping --energy of its "
        "energy Σσ². Reports the captured energy per layer (min / median); 1-D differences (norms, biases) "
        "are counted, not written. Output keys use the checkpoint's own module names: diffusers-named "
        "weights in diffusers' layout (unet./transformer./text_encoder. + lora_A/lora_B, which its loader "
        "reads), original (ldm/BFL) names in ComfyUI's (diffusion_model. + lora_down/lora_up, alpha = rank); "
        "scale 1 either way.",
    )
    p.add_argument("base", help="base checkpoint (.safetensors file, component or pipeline folder)")
    p.add_argument("tuned", help="fine-tuned checkpoint with the same tensor names")
    p.add_argument(
        "--min-diff",
        type=non_negative_arg,
        default=0.0,
        help="skip layers whose |ΔW|/|W| is below this (>= 0)",
    )
    p.add_argument(
        "--skip-rounding",
        action="store_true",
        help="leave out layers whose difference is only the rounding of BASE's wider dtype to TUNED's "
        "(fp32 base, fp16 tuned: no fine-tuning in them; counted in a warning otherwise)",
    )
    lowrank_options(p, pickle=False)


def run(args: argparse.Namespace) -> int:
    refuse_output(args.output, [args.base, args.tuned], args.force)
    from ..tools.extract import extract

    res = extract(
        args.base,
        args.tuned,
        args.output,
        rank=args.rank,
        energy=args.energy,
        dtype=args.dtype,
        min_rel_diff=args.min_diff,
        skip_rounding=args.skip_rounding,
        overwrite=args.force,
        allow_empty=args.allow_empty,
        progress=progress_wanted(args),
    )
    return print_lowrank(res, args, "extracted")
