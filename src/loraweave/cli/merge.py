"""`loraweave merge`: several adapters at their strengths as one LoRA file (argument handling and printing;
the library side is `loraweave.tools.merge`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .support import (
    FORCE_HELP,
    adapter_arg,
    add_common,
    limit_arg,
    progress_wanted,
    rank_arg,
    refuse_output,
)


def add(sub) -> None:
    p = sub.add_parser(
        "merge",
        help="merge several adapters at their strengths into one LoRA file",
        description="Example: loraweave merge A.safetensors:0.7 B.safetensors:0.5 -o AB.safetensors "
        "[--rank 32]. "
        "Writes A at strength 0.7 plus B at 0.5 (and so on) as one LoRA, as kohya's merge_lora.py and "
        "svd_merge_lora.py do. Every file is resolved against the model (detected, or --arch/--model), so"
        " files of different layouts meet on the same modules. LoRA parts are concatenated along the rank"
        " with strength·alpha/rank folded into their up factors (alpha = rank): applying the result "
        "equals applying the sources at their strengths, to fp32 rounding. LoKr/LoHa/full parts join as "
        "the SVD of their ΔW and need --rank. With --rank R, every module whose concatenated rank is "
        "above R is truncated by SVD and its captured share of Σσ² reported. The output records its "
        "sources and strengths, keeps trigger phrases and tag counts of all, and is written atomically "
        "(nothing on failure).",
    )
    p.add_argument(
        "adapters",
        nargs="+",
        type=adapter_arg,
        metavar="FILE[:STRENGTH]",
        help="adapter .safetensors file or PEFT folder, with its strength (default 1)",
    )
    p.add_argument("-o", "--output", required=True, help="output .safetensors file (written atomically)")
    p.add_argument(
        "--rank",
        type=rank_arg,
        help="truncate modules above this rank by SVD (energy reported); LoKr/LoHa/full parts need it",
    )
    p.add_argument(
        "--to",
        choices=["kohya", "comfy", "diffusers"],
        default="kohya",
        help="output layout (default kohya: lora_unet_/lora_te_ names that A1111, Forge and ComfyUI read)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--arch", help="architecture to resolve against (default: detected, must agree)")
    where.add_argument("--model", help="checkpoint (file or folder) to resolve against instead")
    p.add_argument(
        "--dtype", choices=["fp32", "fp16", "bf16"], help="factor dtype (default: the widest input's)"
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--json", action="store_true", help="print sources, per-module ranks and energies as JSON")
    p.add_argument("--limit", type=limit_arg, default=5, help="lowest-energy modules to list (default 5)")
    add_common(p, pickle=True)


def run(args: argparse.Namespace) -> int:
    refuse_output(args.output, [path for path, _ in args.adapters], args.force)
    from ..tools.merge import merge

    res = merge(
        args.adapters,
        args.output,
        rank=args.rank,
        to=args.to,
        arch=args.arch,
        model=args.model,
        dtype=args.dtype,
        overwrite=args.force,
        progress=progress_wanted(args),
        allow_pickle=args.allow_pickle,
    )
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    ranks = sorted({la["rank"] for la in res.layers})
    named = ", ".join(f"{Path(s['file']).name}:{s['strength']:g}" for s in res.sources)
    print(
        f"merged {named} into {res.targets} modules ({res.layout} layout, ranks {ranks[0]}...{ranks[-1]}) "
        f"-> {res.output}"
    )
    if res.exact:
        print("exact: rank concatenation, no truncation")
    else:
        worst = sorted(res.layers, key=lambda la: la["energy"])
        print(f"truncated to rank {args.rank}: captured energy min {worst[0]['energy']:.6f}")
        for la in worst[: args.limit]:
            print(f"  {la['energy']:.6f}  rank {la['rank']:>4}  {la['name']}")
    for note in res.notes:
        print(f"note: {note}")
    return 0
