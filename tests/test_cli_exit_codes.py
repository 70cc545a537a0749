"""One exit-status table for every CLI command: each --help prints it (with the clauses of the options that
command has), the README holds the same codes, and every command exits with the table's code for an invalid
argument, a system error, a bug and an interrupt."""

from __future__ import annotations

import argparse
import errno
import re
from pathlib import Path

import pytest

from loraweave.cli import build_parser, main
from loraweave.cli.support import EXIT_STATUS, STATUS_TITLE

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sorted(sub.choices)


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its command line, the nested `comfy install | uninstall` too."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            if isinstance(action.choices, dict):  # a sub-command action: name -> parser
                for name, child in action.choices.items():
                    found[f"{prefix} {name}".strip()] = child
                    walk(f"{prefix} {name}", child)

    walk("", build_parser())
    return found


def _options(command: str) -> set[str]:
    """The options of a command and of the commands under it (`comfy`'s table covers install, demo, ...)."""
    return {
        o
        for name, parser in _parsers().items()
        if name == command or name.startswith(f"{command} ")
        for action in parser._actions
        for o in action.option_strings
    }


def _codes(text: str) -> set[int]:
    return {int(m) for m in re.findall(r"^\s*\|?\s*(\d+)\s", text, re.M)}


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_table_is_the_same_in_readme_and_code():
    table = _codes(EXIT_STATUS)
    assert table == {0, 1, 2, 3, 4, 130}
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("| status | meaning |") :]
    section = section[: section.index("\n\n")]
    assert _codes(section) == table


def test_the_top_help_shows_the_whole_table(capsys):
    out = _help([], capsys)
    for line in EXIT_STATUS.splitlines():
        assert line.strip() in out


@pytest.mark.parametrize("command", sorted(_parsers()))
def test_every_help_shows_the_table(command, capsys):
    out = _help(command.split(), capsys)
    table = out[out.index(STATUS_TITLE) :]
    own = _options(command)
    # 1 only where an option can make it (--strict, or a refused empty output without --allow-empty)
    assert _codes(table) == {0, 2, 3, 4, 130} | ({1} if own & {"--strict", "--allow-empty"} else set())
    for line in EXIT_STATUS.splitlines():  # the lines that name no option, as in the whole table
        if line.startswith(("  0 ", "  3 ", "  4 ", "  130 ")):
            assert line in table


@pytest.mark.parametrize("command", sorted(_parsers()))
def test_no_help_names_an_option_its_command_lacks(command, capsys):
    """`comfy install --help` said "with --strict ..." and "--allow-empty was not given" (it has neither)."""
    said = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _help(command.split(), capsys)))
    assert said - _options(command) == set()


# One invalid argument per command, with the code the table gives it (2: bad input or usage).
INVALID = {
    "demo": (["demo", "--out"], 2),
    "inspect": (["inspect", "{tmp}/missing.safetensors"], 2),
    "bake": (["bake", "{tmp}/m.safetensors", "{tmp}/a.safetensors:nan", "-o", "{tmp}/o.safetensors"], 2),
    "convert": (["convert", "{tmp}/a.safetensors", "--to", "nope", "-o", "{tmp}/o"], 2),
    "extract": (["extract", "{tmp}/b.safetensors", "{tmp}/t.safetensors", "--rank", "0", "-o", "{tmp}/o"], 2),
    "resize": (["resize", "{tmp}/a.safetensors", "--energy", "0", "-o", "{tmp}/o"], 2),
}


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse usage errors
        return int(exc.code)


@pytest.mark.parametrize("command", _commands())
def test_every_command_refuses_an_invalid_argument(command, tmp_path, capsys):
    argv, code = INVALID.get(command, ([command, "--no-such-option"], 2))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert _run(argv) == code
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.safetensors").exists()
    # An unknown option is a usage error for every command, too.
    assert _run([command, "--no-such-option"]) == 2


@pytest.mark.parametrize(
    "raised, code",
    [
        (OSError(errno.ENOSPC, "No space left on device"), 3),
        (PermissionError(errno.EACCES, "Permission denied"), 3),
        (RuntimeError("boom"), 4),
        (KeyboardInterrupt(), 130),
    ],
)
def test_system_errors_bugs_and_interrupts(raised, code, monkeypatch, capsys, tmp_path):
    import loraweave.tools.inspect as inspect_mod

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(inspect_mod, "inspect_adapter", fail)
    assert main(["inspect", str(tmp_path / "x.safetensors")]) == code
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("loraweave: error:")
    assert ("Traceback" in err) == (code == 4)  # a traceback only for bugs


def test_a_command_added_later_gets_the_table_too():
    import argparse

    from loraweave.cli.support import with_exit_status

    parser = argparse.ArgumentParser(prog="x")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("new", epilog="A long paragraph of the command's own that should still be wrapped " * 3)
    with_exit_status(parser, sub)
    text = sub.choices["new"].format_help()
    assert EXIT_STATUS.splitlines()[1] in text and max(len(line) for line in text.splitlines()) <= 120
