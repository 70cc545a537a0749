"""What every CLI command shares: the exit-code table, argument types with the API's rules, logging set-up
(one `loraweave` prefix, optional packages quiet), progress policy and the common flags."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import textwrap
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import arguments
from ..errors import (
    ArgumentError,
    EmptyOutputError,
    LoraweaveError,
    NoKeysLandedError,
    StrictApplyError,
    UnsafeFormatError,
)

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT, EXIT_SYSTEM, EXIT_BUG, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130


@dataclass(frozen=True)
class StatusLine:
    """One code of the exit-status table: its meaning, then clauses of which some are about one option."""

    code: int
    meaning: str
    clauses: tuple[tuple[str | None, str], ...] = ()  # (the option a clause is about, or None; its text)
    joiner: str = ", "

    def text(self, has: Callable[[str], bool]) -> str | None:
        """The line for a command with the options `has` accepts; None when no clause applies to it."""
        kept = [text for option, text in self.clauses if option is None or has(option)]
        if self.clauses and not kept:
            return None
        return self.meaning + self.joiner.join(kept)


STATUS_LINES = (
    StatusLine(EXIT_OK, "did what was asked"),
    StatusLine(
        EXIT_INCOMPLETE,
        "completed but incomplete: ",
        (
            ("--strict", "with --strict some key does not land (nothing written)"),
            (
                "--allow-empty",
                "nothing to do: the output would have no effect (no key lands, no layer differs) and "
                "--allow-empty was not given",
            ),
        ),
        joiner=", or ",
    ),
    StatusLine(
        EXIT_BAD_INPUT,
        "bad input or usage: ",
        (
            (None, "a bad argument (out of range, not finite), an unreadable or malformed file"),
            ("--allow-pickle", "a pickle without --allow-pickle"),
            (
                "--force",
                "an output that exists (no --force), would overwrite an input, lies in a folder that does "
                "not exist or is of the other kind (a folder where a file is written); --force replaces only "
                "the command's own files",
            ),
        ),
    ),
    StatusLine(EXIT_SYSTEM, "system error: reading or writing failed (disk full, permission denied)"),
    StatusLine(EXIT_BUG, "internal error: a bug in loraweave (the traceback is printed; please report it)"),
    StatusLine(
        EXIT_INTERRUPTED,
        "interrupted (Ctrl-C); outputs are written atomically, so nothing half-written is left",
    ),
)
STATUS_TITLE = "exit status (each code means the same for every command):"


def exit_status_table(has: Callable[[str], bool] = lambda option: True) -> str:
    """The table as a command's --help prints it: only the clauses about options it has (all by default)."""
    lines = [STATUS_TITLE]
    for status in STATUS_LINES:
        text = status.text(has)
        if text is not None:
            lines += textwrap.wrap(
                text,
                width=110,
                initial_indent=f"  {status.code:<5}",
                subsequent_indent=" " * 7,
                break_on_hyphens=False,
                break_long_words=False,
            )
    return "\n".join(lines)


EXIT_STATUS = exit_status_table()  # every command's clauses: the top --help and the README's table

# Optional quantization packages (and what imports them) log import-time warnings about kernels this machine
# lacks; the CLI shows them only under -v.
NOISY_LOGGERS = (
    "bitsandbytes",
    "torchao",
    "torch.utils._pytree",
    "diffusers",
    "transformers",
    "optimum",
    "sdnq",
    "gguf",
)

QUIET_ENV = {"DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error"}


ARCH_NAMES = "{architecture names}"  # in a help text: filled from the registry only when --help is shown


def arch_names() -> str:
    """Every name `--arch` accepts (each architecture with a skeleton, then its aliases): the registry."""
    from ..arch import registry

    known = [a for a in registry.ARCHITECTURES if a.skeleton is not None]
    names = sorted(a.name for a in known)
    aliases = sorted(alias for a in known for alias in a.cli_names if alias not in names)
    return ", ".join(names) + (f"; aliases: {', '.join(aliases)}" if aliases else "")


class Formatter(argparse.HelpFormatter):
    """Wraps paragraphs as usual but keeps a paragraph with line breaks (the exit-status table) as written;
    fills ARCH_NAMES in option help (the registry is read for --help, not on every run)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = super()._get_help_string(action)
        return text.replace(ARCH_NAMES, arch_names()) if text and ARCH_NAMES in text else text

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n\n".join(
            "".join(indent + line for line in para.splitlines(keepends=True))
            if "\n" in para
            else super(Formatter, self)._fill_text(para, width, indent)
            for para in text.split("\n\n")
        )


def _has_option(p: argparse.ArgumentParser) -> Callable[[str], bool]:
    """Whether `p` takes a flag option (store_true: its default is False, where an unknown one is None)."""
    return lambda option: p.get_default(option.lstrip("-").replace("-", "_")) is not None


def with_exit_status(parser: argparse.ArgumentParser, sub) -> None:
    """Every command's --help (and the top one) ends with the exit-status table, whoever added the command:
    a command's names only its own options, `parser`'s those of any of its commands."""
    commands = [_has_option(p) for p in sub.choices.values()]
    own = _has_option(parser)
    tables = {parser: exit_status_table(lambda option: own(option) or any(c(option) for c in commands))}
    tables |= {p: exit_status_table(has) for p, has in zip(sub.choices.values(), commands, strict=True)}
    for p, table in tables.items():
        if STATUS_TITLE not in (p.epilog or ""):  # a nested command's own call came first
            p.epilog = f"{p.epilog}\n\n{table}" if p.epilog else table
        p.formatter_class = Formatter


class _Prefixed(logging.Formatter):
    """`loraweave key=value ...`: messages that already start with the logger's name are not prefixed
    twice."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.WARNING and not message.startswith("loraweave"):
            return f"loraweave {record.levelname.lower()}: {message}"
        return message if message.startswith("loraweave") else f"loraweave {message}"


def configure_logging(verbose: bool):
    """One handler on the `loraweave` logger; returns a function that undoes every change (tests call
    main())."""
    log = logging.getLogger("loraweave")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Prefixed())
    old = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.propagate = False
    quieted = {}
    env = {k: os.environ.get(k) for k in QUIET_ENV}
    if not verbose:
        for k, v in QUIET_ENV.items():  # diffusers/transformers reset their loggers' level on first import
            os.environ.setdefault(k, v)
        for name in NOISY_LOGGERS:
            quieted[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(logging.ERROR)
    catcher = warnings.catch_warnings()
    catcher.__enter__()
    if not verbose:
        warnings.simplefilter("ignore")

    def restore() -> None:
        catcher.__exit__(None, None, None)
        for k, v in env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        for name, level in quieted.items():
            logging.getLogger(name).setLevel(level)
        log.removeHandler(handler)
        log.setLevel(old[0])
        log.propagate = old[1]

    return restore


def _typed(rule, label: str, *rest):
    """An argparse type applying `rule` (an `arguments` check) to the flag's text; the message names the
    flag."""

    def parse(text: str):
        try:
            return rule(text, label, *rest)
        except ArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def integer_arg(label: str, minimum: int = 1, maximum: int | None = None):
    """An argparse type for an integer flag in [minimum, maximum], named `label` in its messages."""
    return _typed(arguments.integer_text, label, minimum, maximum)


def number_arg(label: str, minimum: float, maximum: float, low_open: bool = False):
    """An argparse type for a finite number flag in [minimum, maximum] ((minimum, maximum] when `low_open`),
    named `label` in its messages."""
    return _typed(arguments.number_text, label, minimum, maximum, low_open)


rank_arg = integer_arg("--rank")
energy_arg = number_arg("--energy", 0, 1, low_open=True)
non_negative_arg = number_arg("--min-diff", 0, math.inf)
limit_arg = integer_arg("--limit", 0)


def adapter_arg(text: str) -> tuple[str, float]:
    """`FILE[:STRENGTH]` as an argparse type: a bad strength is a usage error with the one strength
    message."""
    from ..arguments import parse_adapter_arg

    try:
        return parse_adapter_arg(text)
    except ArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def modality_arg(text: str) -> tuple[str, float]:
    """`NAME=STRENGTH` (--modality) as an argparse type: NAME one of video, audio, cross; the strength by
    the one strength rule."""
    from ..arch.record import MODALITIES

    name, eq, value = text.partition("=")
    name = name.strip().lower()
    if not eq or name not in MODALITIES:
        raise argparse.ArgumentTypeError(
            f"--modality {text!r}: write NAME=STRENGTH with NAME one of {', '.join(MODALITIES)}"
        )
    try:
        return name, arguments.strength_text(value.strip(), f"--modality {name}")
    except ArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


FORCE_HELP = (
    "replace an existing output: only the files this command writes (a folder's other files stay); "
    "never an input"
)


def refuse_output(output: str, inputs: list[str], force: bool, folder: bool = False) -> None:
    """The output check the library makes again, here before torch is imported: a refusal comes at once."""
    from ..io.output import check_output

    check_output(output, inputs, overwrite=force, folder=folder)


def add_common(p: argparse.ArgumentParser, pickle: bool = False, empty: bool = False) -> None:
    """--quiet (no progress bar) everywhere; --allow-pickle where adapters are read; --allow-empty where
    written."""
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar (bars show only on a terminal, never under --json)",
    )
    if pickle:
        p.add_argument(
            "--allow-pickle",
            action="store_true",
            help="read .pt/.ckpt/.bin/.pth adapters with "
            "torch.load(weights_only=True) (a pickle can run code: only for files you trust)",
        )
    if empty:
        p.add_argument(
            "--allow-empty",
            action="store_true",
            help="write the output even when it would have no effect (default: refuse with exit status 1)",
        )


def progress_wanted(args: argparse.Namespace) -> bool:
    return not getattr(args, "json", False) and not getattr(args, "quiet", False) and sys.stderr.isatty()


def silence_stdout() -> None:
    """Stdout's reader went away (`| head`): the command ends quietly, as Unix tools do. Stdout goes to
    /dev/null so the interpreter's own flush at exit finds nothing to complain about."""
    with contextlib.suppress(OSError, ValueError):  # stdout may be a test's capture without a descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def exit_code(exc: BaseException, args: argparse.Namespace) -> tuple[int, str]:
    """(exit status from EXIT_STATUS, one-line message) for an exception a command raised."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED, "interrupted"
    if isinstance(exc, (StrictApplyError, NoKeysLandedError, EmptyOutputError)):
        return EXIT_INCOMPLETE, error_message(exc)
    if isinstance(exc, UnsafeFormatError):
        from ..formats.adapter import PICKLE_SUFFIXES

        where = exc.path or "adapter"
        if exc.path is not None and Path(exc.path).suffix.lower() not in PICKLE_SUFFIXES:
            pickles = (
                " (or a pickle .pt/.ckpt/.bin/.pth with --allow-pickle)"
                if hasattr(args, "allow_pickle")
                else ""
            )
            return (
                EXIT_BAD_INPUT,
                f"{where}: not a .safetensors file; adapters are read from .safetensors{pickles}",
            )
        if hasattr(args, "allow_pickle"):
            return EXIT_BAD_INPUT, (
                f"{where}: a pickle file (.pt/.ckpt/.bin/.pth) can run arbitrary code when "
                "loaded; convert it to .safetensors, or pass --allow-pickle to read it with "
                "torch.load(weights_only=True)"
            )
        return (
            EXIT_BAD_INPUT,
            f"{where}: only .safetensors is read here; convert the pickle to .safetensors first",
        )
    if isinstance(
        exc,
        (
            LoraweaveError,
            ValueError,
            FileNotFoundError,
            IsADirectoryError,
            NotADirectoryError,
            FileExistsError,
        ),
    ):
        return EXIT_BAD_INPUT, error_message(exc)
    if isinstance(exc, OSError):
        return EXIT_SYSTEM, error_message(exc)
    traceback.print_exception(exc, file=sys.stderr)
    return EXIT_BUG, f"internal error {type(exc).__name__}: {exc} (a bug in loraweave; please report it)"


# The API's keywords in library messages, and the flag a CLI user passes instead.
CLI_WORDS = {
    "Pass allow_empty=True to apply anyway": "Pass --allow-empty to go on anyway",
    "allow_empty=True": "--allow-empty",
    "allow_other_arch=True": "--allow-other-arch",
    "allow_pickle=True": "--allow-pickle",
    "strict=True": "--strict",
}


def cli_words(message: str) -> str:
    """A library message as a CLI user reads it: flags, never API keywords."""
    for api, flag in CLI_WORDS.items():
        message = message.replace(api, flag)
    return message


def print_json_error(args: argparse.Namespace, message: str, code: int, **extra: object) -> None:
    """A failure under --json: `{"error", "exit_status"}` on stdout (plus the adapter's `file` and `path` for
    `inspect FILE`, as a folder's row has them, and what the caller adds), the same for every command."""
    where: dict[str, object] = {}
    if args.command == "inspect" and isinstance(args.file, str):
        where = {"file": Path(args.file).name, "path": args.file}
    print(json.dumps({**where, "error": message, "exit_status": code, **extra}, indent=2))


def error_message(exc: BaseException) -> str:
    """One line for an error: an OS error as 'PATH: reason' (no class name, no '[Errno N]'), a library message
    with flags for API keywords."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror
    return cli_words(str(exc))


def lowrank_options(p: argparse.ArgumentParser, pickle: bool) -> None:
    """The options extract and resize share: output, rank/energy, dtype, --force, --json, --limit."""
    p.add_argument("-o", "--output", required=True, help="output .safetensors file (written atomically)")
    p.add_argument(
        "--rank", type=rank_arg, help="rank per layer, an integer >= 1 (the cap when --energy is also given)"
    )
    p.add_argument(
        "--energy",
        type=energy_arg,
        help="per layer, the smallest rank keeping this share of Σσ², in (0, 1] (e.g. 0.99)",
    )
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], help="factor dtype (default: the input's)")
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
    p.add_argument("--json", action="store_true", help="print per-layer ranks and energies as JSON")
    p.add_argument("--limit", type=limit_arg, default=10, help="lowest-energy layers to list (default 10)")
    add_common(p, pickle=pickle, empty=True)


def print_lowrank(res, args: argparse.Namespace, verb: str) -> int:
    """extract's and resize's output: JSON, or the rank range and the lowest-energy layers."""
    if args.json:
        print(json.dumps(res.to_dict(), indent=2))
        return 0
    ranks = sorted({la["rank"] for la in res.layers})
    print(
        f"{verb} {len(res.layers)} layers into {res.output} (ranks {ranks[0] if ranks else '-'}..."
        f"{ranks[-1] if ranks else '-'}) in {res.seconds:.2f}s"
    )
    if res.layers:
        print(f"captured energy per layer: min {res.energy_min:.6f}, median {res.energy_median:.6f}")
        worst = sorted(res.layers, key=lambda la: la["energy"])[: args.limit]
        for la in worst:
            print(f"  {la['energy']:.6f}  rank {la['rank']:>4}  {la['name']}")
    for reason, n in res.skipped.items():
        print(f"skipped {n}: {reason}")
    return 0
