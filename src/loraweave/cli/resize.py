"""`loraweave resize`: re-rank an adapter as a LoRA of rank R (argument handling; the library side is
`loraweave.tools.resize`)."""

from __future__ import annotations

import argparse

from .support import ARCH_NAMES, lowrank_options, print_lowrank, progress_wanted, refuse_output


def add(sub) -> None:
    p = sub.add_parser(
        "resize",
        help="re-rank an adapter: LoRA/LoHa/LoKr/full -> LoRA of rank R",
        description="Rewrite every LoRA, LoHa, LoKr or full-diff part of an adapter as a LoRA of rank --rank "
        "(or the smallest rank keeping --energy of Σσ²), with its alpha/rank scale folded in and alpha = "
        "rank. LoRA parts are truncated through QR of the factors (ΔW is never formed); the others one ΔW at "
        "a time. Reports captured energy per layer; families that need the base weight (OFT, DoRA, IA3, "
        "GLoRA) are refused. Positional (cloneofsimo) files are named on the architecture they fit (or "
        "--arch) and written in the diffusers layout.",
    )
    p.add_argument("file", help="adapter .safetensors file or PEFT folder")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--arch",
        help=f"architecture that gives conv kernel shapes flat-stored factors lack (default: detected): "
        f"{ARCH_NAMES}",
    )
    where.add_argument("--model", help="checkpoint that gives those shapes instead")
    lowrank_options(p, pickle=True)


def run(args: argparse.Namespace) -> int:
    refuse_output(args.output, [args.file], args.force)
    from ..tools.resize import resize

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
    return print_lowrank(res, args, "resized")
