"""`loraweave inspect FILE | DIR`: what an adapter file is and how much of it lands on a model, one row per
adapter of a folder, `--plot OUT.png` a heatmap (argument handling and printing; the library side is
`loraweave.tools.inspect`, `tools.inspect_dir`, `tools.plot` and `tools.heatmap`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import LoraweaveError
from .support import ARCH_NAMES, add_common, limit_arg, progress_wanted


def add(sub) -> None:
    p = sub.add_parser(
        "inspect",
        help="what an adapter file is and how much of it lands on a model",
        description="Show an adapter's layout, families, ranks, alphas (and where they come from), dtypes, "
        "metadata and detected architecture with its evidence, then resolve every key against the "
        "architecture (full size on the meta device: no weights, no download) or a checkpoint, listing "
        "unmatched keys and why.",
        epilog="JSON (--json) always has layout, families, architecture {name, evidence}, "
        "coverage {keys_total, keys_applied, unmatched}.",
    )
    p.add_argument(
        "file",
        nargs="+",
        help=".safetensors adapter file, PEFT directory, or a folder of adapters (one row each); several "
        "files (a shell glob) give one row each too",
    )
    p.add_argument("--plot", metavar="OUT.png", help="also draw a heatmap of ‖ΔW‖ per block × module kind")
    p.add_argument(
        "--force", action="store_true", help="with --plot: replace an existing OUT.png (never an input)"
    )
    p.add_argument(
        "--metric",
        choices=["norm", "energy"],
        default="norm",
        help="--plot cell value: ‖ΔW‖_F (default) or share of the total Σ‖ΔW‖²",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--arch",
        help=f"resolve against this architecture instead of the detected one: {ARCH_NAMES}",
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
        help="describe the file alone: no model is built and no key resolved (fast: torch is not imported; a "
        "UNet file is not told apart as sd1/sd2/sdxl, which takes fitting); JSON coverage has checked=false; "
        "not with --plot, which resolves every key",
    )
    p.add_argument(
        "--strict", action="store_true", help="exit 1 when coverage is incomplete (or the file is empty)"
    )
    p.add_argument(
        "--limit", type=limit_arg, default=20, help="unmatched keys listed in the table (default 20)"
    )
    add_common(p, pickle=True)


def run(args: argparse.Namespace) -> int:
    if len(args.file) > 1:
        return inspect_several(args)
    args.file = args.file[0]
    if Path(args.file).is_dir() and not (Path(args.file) / "adapter_config.json").is_file():
        return inspect_folder(args)
    from ..tools.inspect import format_table, inspect_adapter

    if args.strict and args.no_coverage:
        print("loraweave inspect: --strict needs coverage; drop --no-coverage", file=sys.stderr)
        return 2
    if args.plot and args.no_coverage:  # the plot would resolve every key, which --no-coverage asks not to do
        print(
            "loraweave inspect: --plot resolves every key against the model; drop --no-coverage",
            file=sys.stderr,
        )
        return 2
    if args.plot:  # refused before the file is read: a bad target, or an existing picture without --force
        from ..io.output import check_output
        from ..tools.heatmap import check_plot_target

        check_output(args.plot, [args.file], overwrite=args.force)
        check_plot_target(args.plot)
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
        info["plot"] = plot_into(args)
    print(json.dumps(info, indent=2) if args.json else format_table(info, args.limit))
    cov = info["coverage"]
    return 1 if args.strict and (cov["complete"] is False or cov["keys_total"] == 0) else 0


def plot_into(args: argparse.Namespace) -> dict:
    """Draw the heatmap of `args.file` into `args.plot`; returns what the JSON output says about it."""
    from ..tools.heatmap import render
    from ..tools.plot import block_grid

    grid = block_grid(
        args.file,
        arch=args.arch,
        model=args.model,
        metric=args.metric,
        allow_pickle=args.allow_pickle,
        text_encoders=not args.no_text_encoders,
    )
    render(grid, args.plot)
    if not args.json:
        print(
            f"plot: {args.plot} ({len(grid.rows)} blocks x {len(grid.columns)} module kinds, {args.metric}"
            + (f"; {len(grid.skipped)} keys not drawn" if grid.skipped else "")
            + ")"
        )
    return {"file": args.plot, **grid.to_dict()}


def inspect_folder(args: argparse.Namespace) -> int:
    """One row per adapter below the folder. Exit 2 if some file is unreadable, 1 if the folder holds no
    adapter or (--strict) some adapter's keys do not all land, else 0."""
    from ..tools.inspect_dir import inspect_folder as inspect_dir

    if args.plot:
        raise LoraweaveError("--plot draws one adapter: pass a file, not a folder")
    rows, left_out = inspect_dir(args.file, **row_options(args))
    return print_rows(args, rows, left_out, f"in {args.file}")


def row_options(args: argparse.Namespace) -> dict:
    """The options a folder's and several paths' rows are inspected with (the same for both)."""
    return {
        "progress": progress_wanted(args),
        "arch": args.arch,
        "model": args.model,
        "allow_pickle": args.allow_pickle,
        "text_encoders": not args.no_text_encoders,
        "check_values": args.check_values,
    }


def inspect_several(args: argparse.Namespace) -> int:
    """`inspect a.safetensors b.safetensors ...`: one row each, as for a folder (the same exit statuses)."""
    from ..tools.inspect_dir import inspect_paths

    if args.plot:
        raise LoraweaveError("--plot draws one adapter: pass one file")
    folders = [f for f in args.file if Path(f).is_dir() and not (Path(f) / "adapter_config.json").is_file()]
    if folders:
        raise LoraweaveError(f"{folders[0]}: a folder among several paths; pass adapter files, or one folder")
    rows = inspect_paths(args.file, **row_options(args))
    return print_rows(args, rows, [], "given")


def print_rows(args: argparse.Namespace, rows: list[dict], left_out: list[dict], where: str) -> int:
    """The table (or JSON list) of one row per adapter; exit 2 if some is unreadable, 1 if none is given or
    (--strict) some adapter's keys do not all land, else 0."""
    from ..tools.inspect_dir import format_folder

    print(json.dumps(rows, indent=2) if args.json else format_folder(rows, left_out))
    if left_out and args.json:
        for x in left_out:
            print(f"loraweave: left out {x['file']}: {x['reason']}", file=sys.stderr)
    if any("error" in r for r in rows):
        for r in rows:
            if "error" in r:  # the message names its file already when it starts with it
                named = r["error"].startswith((r["path"], r["file"]))
                print(f"loraweave: error: {'' if named else r['path'] + ': '}{r['error']}", file=sys.stderr)
        return 2
    if not rows:
        print(f"loraweave: no adapter files {where}", file=sys.stderr)
        return 1
    return 1 if args.strict and not all(r["coverage"]["complete"] for r in rows) else 0
