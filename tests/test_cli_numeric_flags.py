"""Every numeric flag of every command refuses a bad value with a true message that names the flag (issue 30
item 7): never argparse's 'invalid int value', never a message that calls '1e9' 'not a number'."""

from __future__ import annotations

import argparse

import pytest

from loraweave.cli import build_parser, main
from loraweave.cli.support import adapter_arg, modality_arg

BAD_VALUES = ("abc", "nan", "inf", "-inf", "1e400", "1e9", "2.5", "-1", "99999999999999999999999")
# (flag, value) pairs that are right: a negative seed asks for a random one; a 1e9 threshold is a number
ACCEPTED = {
    ("--seed", "-1"),
    ("--min-diff", "1e9"),
    ("--min-diff", "2.5"),
    ("--min-diff", "99999999999999999999999"),
    ("--cfg", "2.5"),
    ("--limit", "99999999999999999999999"),  # more than there are: list them all
    ("--rank", "99999999999999999999999"),  # a cap: each layer keeps at most its own rank
}
# what each bad value must be called, by kind of flag
INTEGER_FLAGS = {
    "--limit",
    "--rank",
    "--steps",
    "--seed",
    "--width",
    "--height",
    "--replicas",
    "--port",
    "--max-adapters-per-replica",
    "--max-batch",
    "--batch-wait-ms",
    "--threads",
}
NUMBER_FLAGS = {"--cfg", "--energy", "--min-diff"}


def _numeric_actions() -> list[tuple[str, argparse.Action]]:
    """(command, action) for every option of every subcommand that parses its text as a number."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    found = []
    for command, parser in sub.choices.items():
        for action in parser._actions:
            # FILE:S and NAME=S carry a strength by the one strength rule (tested below), not a bare number
            if action.type not in (None, adapter_arg, modality_arg) and action.option_strings:
                found.append((command, action))
    return found


def _long(action: argparse.Action) -> str:
    return next(o for o in action.option_strings if o.startswith("--"))


CASES = [
    pytest.param(action, value, id=f"{command}-{_long(action)}-{value}")
    for command, action in _numeric_actions()
    for value in BAD_VALUES
    if (_long(action), value) not in ACCEPTED
]


def test_the_walk_finds_every_numeric_flag():
    plain = [(c, a.option_strings) for c, a in _numeric_actions() if a.type in (int, float)]
    assert not plain, f"argparse's own int/float types say 'invalid int value': {plain}"
    assert {_long(action) for _, action in _numeric_actions()} == INTEGER_FLAGS | NUMBER_FLAGS


@pytest.mark.parametrize("value", BAD_VALUES)
def test_a_bad_modality_strength_names_the_flag(value):
    if value in ("2.5", "-1", "1e9"):  # a strength may be negative or above 1 (<= 1e4): 1e9 is out of range
        if value != "1e9":
            assert modality_arg(f"audio={value}") == ("audio", float(value))
            return
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        modality_arg(f"audio={value}")
    assert "--modality audio" in str(caught.value) and value in str(caught.value), str(caught.value)


@pytest.mark.parametrize("action, value", CASES)
def test_a_bad_number_has_a_true_message(action, value):
    with pytest.raises(argparse.ArgumentTypeError) as caught:
        action.type(value)
    message = str(caught.value)
    assert any(flag in message for flag in action.option_strings), message
    assert repr(value) in message or str(value) in message, message
    flag = _long(action)
    if value == "abc":
        assert "is not a number" in message
    elif flag in INTEGER_FLAGS:
        assert "must be an integer" in message and "not a number" not in message
    elif value in ("nan", "inf", "-inf", "1e400"):
        assert ("not a finite number" in message) or ("must be a finite number" in message)
    else:
        assert "must be" in message and "not a number" not in message


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "abc"], "argument --steps: --steps: 'abc' is not a number"),
        (["--steps", "1e9"], "--steps must be an integer from 1 to 10000, got '1e9'"),
        (["--steps", "100000"], "--steps must be an integer from 1 to 10000, got 100000"),
        (["-W", "inf"], "-W/--width must be an integer from 8 to 16384, got 'inf'"),
        (["-H", "-64"], "-H/--height must be an integer from 8 to 16384, got -64"),
        (["--cfg", "nan"], "--cfg: 'nan' is not a finite number"),
        (["-s", "1e9"], "-s/--seed must be an integer from"),
    ],
)
def test_generate_says_which_flag_and_why(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "-m", str(tmp_path), "-p", "a cat", *argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and message in err and "invalid" not in err
    assert not list(tmp_path.iterdir())


def test_good_numbers_still_parse():
    args = build_parser().parse_args(
        [
            "generate",
            "-m",
            "x",
            "-p",
            "p",
            "--steps",
            "3",
            "-W",
            "64",
            "-H",
            "128",
            "-s",
            "-5",
            "--cfg",
            "1.5",
        ]
    )
    assert (args.steps, args.width, args.height, args.seed, args.cfg) == (3, 64, 128, -5, 1.5)
