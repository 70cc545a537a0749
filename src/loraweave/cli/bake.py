"""`loraweave bake`: merge adapters into a checkpoint on disk (argument handling and printing; the
library side is `loraweave.tools.bake`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..io.output import check_folder_name
from .support import FORCE_HELP, adapter_arg, add_common, limit_arg, progress_wanted, refuse_output


def add(sub) -> None:
    p = sub.add_parser(
        "bake",
        help="merge adapters into a checkpoint on disk (tensor by tensor)",
        description="Merge LoRA/LyCORIS adapters into a checkpoint: a single .safetensors file, a (sharded) "
        "diffusers component folder with its index, or a diffusers pipeline folder. Keys resolve against the "
        "checkpoint's own tensor names (no model is built); each tensor is read, merged (fp32 accumulation, "
        "one rounding, identical to apply(mode='merge')) and written alone, so memory stays near the largest "
        "tensor. The output is written to a temp path next to the target and renamed into place only when "
        "complete (into an existing folder, with --force, file by file: the folder's other files stay); it "
        "may not overwrite an input. Every output file's metadata records the adapters, their sha256, "
        "strengths and the tool version. Strengths follow AdapterSpec's rule: finite, |s| <= 1e4. Positional "
        "(cloneofsimo) files are named on the architecture they fit, by the resolver apply uses.",
    )
    p.add_argument("model", help="checkpoint: .safetensors file, component folder or pipeline folder")
    p.add_argument(
        "lora",
        nargs="+",
        type=adapter_arg,
        metavar="FILE[:S]",
        help="adapter file, optionally with a strength: FILE[:STRENGTH] (default 1.0)",
    )
    p.add_argument("-o", "--output", required=True, help="output file (single-file input) or folder")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="cast floating tensors of the output")
    p.add_argument("--strict", action="store_true", help="write nothing unless every key lands (else exit 1)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--limit", type=limit_arg, default=20, help="keys not applied to list (default 20)")
    add_common(p, pickle=True, empty=True)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.model).is_dir()  # a folder bakes into a folder of the same shape
    refuse_output(args.output, [args.model, *(a for a, _ in args.lora)], args.force, folder=folder)
    if folder:
        check_folder_name(args.output, f"{args.model} is a folder, so the baked model is a folder")
    from ..tools.bake import bake

    res = bake(
        args.model,
        args.lora,
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
        f"baked {len(res.adapters)} adapter(s) into {res.output}: {res.tensors_changed} of {res.tensors} "
        f"tensors changed, {res.keys_applied}/{res.keys_total} keys applied, {res.bytes_written / 2**20:.1f} "
        f"MiB written in {res.seconds:.2f}s"
    )
    for u in res.unmatched[: args.limit]:
        print(f"  not applied: {u['key']}: {u['reason']}")
    if len(res.unmatched) > args.limit:
        print(f"  ... {len(res.unmatched) - args.limit} more not applied (--json lists all)")
    return 0
