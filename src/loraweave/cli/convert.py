"""`loraweave convert`: rewrite a LoRA in another trainer layout (argument handling and printing; the
library side is `loraweave.tools.convert`)."""

from __future__ import annotations

import argparse
import json

from .support import FORCE_HELP, add_common, progress_wanted, rank_arg, refuse_output


def add(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="rewrite a LoRA in another trainer layout (kohya, peft, diffusers, comfy)",
        description="Convert a LoRA between layouts: kohya (lora_unet_/lora_te_, underscored; original names "
        "for SDXL and DiTs), peft (folder: adapter_model.safetensors + adapter_config.json), diffusers "
        "(component-prefixed lora_A/lora_B, alpha in lora_adapter_metadata), comfy "
        "(diffusion_model.<original names>). Keys are resolved against the model (full size on the meta "
        "device, from --arch or detection, or --model), so fused rows are split (shared down, up rows cut) "
        "or joined (shared down when equal, else rank concatenation) exactly as the target naming needs; "
        "alpha is carried so alpha/rank is unchanged. LoKr and LoHa parts keep their family in the kohya "
        "and comfy layouts (only where a part lands whole on one module); with --rank R they become LoRAs of "
        "rank <= R (truncated SVD of each part's ΔW; the captured share of Σσ² is reported). The source's "
        "metadata (trigger words, tag frequencies, training info) is carried over; hashes of the source file "
        "and rank/alpha records the conversion changes are dropped, and the summary names them. The result "
        "is re-resolved before writing. Other families, and keys that do not resolve, are refused.",
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
    p.add_argument(
        "--rank",
        type=rank_arg,
        help="write LoKr/LoHa parts as LoRAs of this rank (truncated SVD; LoRA parts are kept as they are)",
    )
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument(
        "--drop-embeddings",
        action="store_true",
        help="leave out textual-inversion token embeddings (<s1>, ...), which no adapter layout carries",
    )
    add_common(p, pickle=True, empty=True)


def run(args: argparse.Namespace) -> int:
    refuse_output(args.output, [args.file], args.force, folder=args.to == "peft")
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
        drop_embeddings=args.drop_embeddings,
        rank=args.rank,
    )
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    print(
        f"converted {res.keys_in} keys to {res.layout} layout: {res.keys_out} keys on {res.targets} targets "
        f"({res.splits} split, {res.joins} joined) -> {res.output}"
    )
    if res.as_is:
        print(f"{res.as_is} LoKr/LoHa parts written as they are")
    if res.lowrank:
        energies = sorted(la["energy"] for la in res.lowrank)
        print(
            f"{len(res.lowrank)} LoKr/LoHa parts as LoRA of rank <= {args.rank}: captured energy min "
            f"{energies[0]:.6f}, median {energies[len(energies) // 2]:.6f}"
        )
    rewritten = ", ".join(sorted(res.metadata_rewritten)) or "none"
    print(f"metadata: {res.metadata_kept} fields carried over; rewritten or dropped: {rewritten}")
    for note in res.notes:
        print(f"note: {note}")
    return 0
