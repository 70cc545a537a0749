"""Command line: `loraweave demo | inspect`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

from .errors import LoraweaveError


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="loraweave-demo-"))
    res = run_demo(out_dir)
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"model: Z-Image transformer (diffusers ZImageTransformer2DModel, seeded), built in {res['build_seconds']:.2f}s")
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
    print(f"  adapters: {json.dumps(report['adapters'][0]['families'])} layout={report['adapters'][0]['layout']} "
          f"alpha_sources={report['adapters'][0]['alpha_sources']}")
    print(f"  per component/mechanism: {report['counts']}")
    print(f"  keys applied {report['keys_applied']}/{report['keys_total']}, unmatched {len(report['unmatched'])}")
    print()
    print(f"largest |runtime - merged| output difference: {res['max_abs_diff_runtime_vs_merge']:.3e} "
          f"(output scale {res['output_scale']:.3f}, LoRA effect {res['lora_effect_max_abs']:.3e})")
    print(f"largest |kohya fused-qkv file - PEFT file| (merged): {res['max_abs_diff_kohya_vs_peft']:.3e}")
    print(f"total {res['total_seconds']:.2f}s")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .formats.adapter import load_adapter
    from .formats.detect import detect_architecture

    adapter = load_adapter(args.file, allow_pickle=args.allow_pickle)
    detection = detect_architecture(adapter)
    info = {
        "name": adapter.name,
        "architecture": detection.architecture,
        "architecture_evidence": detection.evidence,
        "layout": adapter.layout,
        "families": adapter.families,
        "parts": len(adapter.parts),
        "keys_total": adapter.keys_total,
        "components": sorted({p.component for p in adapter.parts}),
        "unparsed": adapter.unparsed,
        "metadata_keys": sorted(adapter.metadata),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            if k == "unparsed":
                print(f"unparsed: {len(v)}")
                for u in v[: args.limit]:
                    print(f"  {u['key']}: {u['reason']}")
            elif k == "metadata_keys" and len(v) > args.limit:
                print(f"metadata_keys: {len(v)} ({', '.join(v[: args.limit])}, ...)")
            else:
                print(f"{k}: {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraweave",
        description="Apply LoRA/LyCORIS adapters to diffusion models: every key lands or is reported.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log key=value summaries at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the embedded demo (small seeded Z-Image model, sample LoRAs)")
    demo.add_argument("--out", help="directory for the sample LoRA files (default: a new temp directory)")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.set_defaults(func=_cmd_demo)
    inspect = sub.add_parser("inspect", help="show an adapter file's layout, families and unparsed keys")
    inspect.add_argument("file", help=".safetensors file or PEFT directory")
    inspect.add_argument("--json", action="store_true", help="print as JSON")
    inspect.add_argument("--limit", type=int, default=20, help="unparsed keys to list (default 20)")
    inspect.add_argument("--allow-pickle", action="store_true", help="read .pt/.ckpt with torch.load(weights_only=True)")
    inspect.set_defaults(func=_cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s %(message)s")
    try:
        return args.func(args)
    except LoraweaveError as exc:
        print(f"loraweave: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
