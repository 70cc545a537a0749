"""Command line: `loraweave demo | inspect | bake | convert | merge | extract | resize | generate | serve`
(the only place that prints).

One module per command, each with `add(subparsers)` (its parser) and `run(args)` (its body, heavy imports
inside); this module builds the parser from them and dispatches. Every command shares one exit-code table
(EXIT_STATUS in `support`, in the README; each --help shows the clauses of its own options), and one rule
for a failure under --json: the error line on stderr, an error object on stdout, the table's status."""

from __future__ import annotations

import argparse
import sys

from . import bake, comfy, convert, demo, extract, generate, inspect, merge, resize, serve
from .support import (
    EXIT_OK,
    configure_logging,
    exit_code,
    print_json_error,
    silence_stdout,
    with_exit_status,
)

COMMANDS = {
    "demo": demo,
    "inspect": inspect,
    "bake": bake,
    "convert": convert,
    "merge": merge,
    "extract": extract,
    "resize": resize,
    "generate": generate,
    "serve": serve,
    "comfy": comfy,
}


VERBOSE_HELP = "log key=value summaries at INFO (and the optional quantization packages' own warnings)"


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="loraweave",
        description="Apply LoRA/LyCORIS adapters to diffusion models: every key lands or is reported.",
    )
    parser.add_argument("--version", action="version", version=f"loraweave {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add(sub)
    for p in sub.choices.values():  # `loraweave bake -v ...` as well; SUPPRESS keeps a -v given before it
        p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=VERBOSE_HELP)
    with_exit_status(parser, sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    restore = configure_logging(args.verbose)
    try:
        code = COMMANDS[args.command].run(args)
        try:
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        except BrokenPipeError:  # the command's own status stands
            silence_stdout()
        return code
    except SystemExit:
        raise
    except BrokenPipeError:  # `loraweave inspect ... | head`: the reader has all it wants
        silence_stdout()
        return EXIT_OK
    except BaseException as exc:  # every failure: one line (a traceback only for bugs), the table's code
        code, message = exit_code(exc, args)
        print(f"loraweave: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):  # one rule for --json: a failure is an error object on stdout too
            print_json_error(args, message, code)
        return code
    finally:
        restore()


if __name__ == "__main__":
    sys.exit(main())
