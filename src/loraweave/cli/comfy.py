"""`loraweave comfy install | uninstall COMFYUI_DIR`: put the ComfyUI node pack's shim into a ComfyUI's
custom_nodes folder, or take it out again (the library side is `loraweave.comfy.install`); `loraweave comfy
demo DIR`: files to try the pack without a real checkpoint (`loraweave.comfy.demo`)."""

from __future__ import annotations

import argparse
import json

from .support import with_exit_status


def add(sub) -> None:
    p = sub.add_parser(
        "comfy",
        help="install the ComfyUI node pack into a ComfyUI folder, remove it, or write files to try it",
        description="ComfyUI finds node packs only in its custom_nodes folders. install writes a small shim "
        "folder (custom_nodes/loraweave_nodes) that loads the nodes from this loraweave; uninstall removes "
        "exactly what install wrote. loraweave must be installed in the Python that runs ComfyUI. demo "
        "writes a tiny model, a LoRA and a workflow to try the nodes without a real checkpoint.",
    )
    actions = p.add_subparsers(dest="comfy_action", required=True)
    for name, text in (
        (
            "install",
            "write the shim into COMFYUI_DIR/custom_nodes (or print the extra_model_paths.yaml entry)",
        ),
        ("uninstall", "remove the shim that install wrote (files changed since are refused)"),
    ):
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument("comfyui_dir", metavar="COMFYUI_DIR", help="the ComfyUI folder (holding main.py)")
        a.add_argument(
            "--base-directory",
            metavar="BASE",
            help="ComfyUI run with --base-directory BASE: use BASE/custom_nodes instead of COMFYUI_DIR's",
        )
        if name == "install":
            a.add_argument(
                "--yaml",
                action="store_true",
                help="write nothing: print the extra_model_paths.yaml entry that loads the pack from this "
                "package",
            )
        a.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    text = (
        "write a tiny Flux model (random weights), a LoRA for it and a workflow into DIR: the pack tried "
        "in ComfyUI without a real checkpoint"
    )
    d = actions.add_parser("demo", help=text, description=f"{text}. Nothing is downloaded.")
    d.add_argument("out", metavar="DIR", help="folder for the files (created if its parent exists)")
    d.add_argument("--force", action="store_true", help="replace the demo's files already in DIR (no other)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    with_exit_status(p, actions)  # the nested install/uninstall/demo --help end with the table too


def run(args: argparse.Namespace) -> int:
    if args.comfy_action == "demo":
        return _demo(args)
    from ..comfy import install

    if args.comfy_action == "install" and args.yaml:
        entry = install.yaml_entry(args.comfyui_dir)
        print(json.dumps({"action": "yaml", "extra_model_paths": entry}) if args.json else entry, end="")
        if args.json:
            print()
        return 0
    do = install.install if args.comfy_action == "install" else install.uninstall
    result = do(args.comfyui_dir, base_directory=args.base_directory)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    verb = "installed" if result.action == "install" else "removed"
    print(f"{verb} {result.shim} ({', '.join(result.files)})")
    if result.left:
        print(f"left in place (not written by loraweave): {', '.join(result.left)}")
    if result.action == "install":
        print("restart ComfyUI to load the LoraWeave nodes")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ..comfy.demo import write_demo

    files = write_demo(args.out, overwrite=args.force)
    if args.json:
        print(json.dumps(files.to_dict(), indent=2))
        return 0
    print(f"model:    {files.model} (a tiny Flux.1-dev, random weights)")
    print(f"lora:     {files.lora}")
    print(f"workflow: {files.workflow}")
    print("start ComfyUI (its Python has loraweave, the pack installed) from its folder with")
    print(f"  python main.py --cpu {files.comfyui_args}")
    print(
        "open http://127.0.0.1:8188, drop the workflow file on the page and run it: the reports show on "
        "LoraWeave Loader, Preview as Text and LoraWeave Inspect"
    )
    return 0
