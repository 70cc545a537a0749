"""`inspect FILE --plot OUT.png` and `inspect DIR` (argument handling and printing; the library side is
`loraweave.tools.plot`, `tools.heatmap` and `tools.inspect_dir`)."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import LoraweaveError


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
    """One row per adapter below the folder. Exit 2 if some file is unreadable, 1 if the folder holds no adapter
    or (--strict) some adapter's keys do not all land, else 0."""
    from ..tools.inspect_dir import format_folder
    from ..tools.inspect_dir import inspect_folder as run

    if args.plot:
        raise LoraweaveError("--plot draws one adapter: pass a file, not a folder")
    show = not args.json and not getattr(args, "quiet", False) and sys.stderr.isatty()
    rows, left_out = run(
        args.file,
        progress=show,
        arch=args.arch,
        model=args.model,
        allow_pickle=args.allow_pickle,
        text_encoders=not args.no_text_encoders,
        check_values=args.check_values,
    )
    print(json.dumps(rows, indent=2) if args.json else format_folder(rows, left_out))
    if left_out and args.json:
        for x in left_out:
            print(f"loraweave: left out {x['file']}: {x['reason']}", file=sys.stderr)
    if any("error" in r for r in rows):
        for r in rows:
            if "error" in r:
                print(f"loraweave: error: {r['path']}: {r['error']}", file=sys.stderr)
        return 2
    if not rows:
        print(f"loraweave: no adapter files in {args.file}", file=sys.stderr)
        return 1
    return 1 if args.strict and not all(r["coverage"]["complete"] for r in rows) else 0
