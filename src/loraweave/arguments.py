"""Rules for numeric arguments, shared by the API, `AdapterSpec` and the CLI so each gives the same message.

Every rule returns the checked value or raises `ArgumentError` (a `ValueError`) naming the argument."""

from __future__ import annotations

import math
import re
from numbers import Integral, Real
from pathlib import Path

from .errors import ArgumentError

MAX_STRENGTH = 1e4  # far above any useful strength, far below fp32 overflow of strength x scale x ΔW
MAX_STEPS = (
    10_000  # sampling steps: far above any sampler's use, low enough that a typo does not run for days
)
MAX_SIDE = (
    16_384  # image side in pixels: a 16k x 16k latent already needs far more memory than any device has
)
MAX_CFG = 1_000.0  # guidance scale: far above any useful value
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes; < 0 means a random seed
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)[bB]?\s*$")
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def number(value: object, label: str) -> float:
    """A real number that is finite (bools and strings are refused: `"0.5"` and `True` are mistakes)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ArgumentError(f"{label} must be a finite number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{label} must be a finite number, got {value!r}")
    return value


def strength(value: object, label: str = "strength") -> float:
    """A finite number with |value| <= MAX_STRENGTH."""
    value = number(value, label)
    if abs(value) > MAX_STRENGTH:
        raise ArgumentError(
            f"{label} must be a finite number of absolute value <= {MAX_STRENGTH:g}, got {value!r}"
        )
    return value


def _finite_text(text: str, prefix: str) -> float:
    """The float the text says, refused with `prefix` when it is no number or not a finite one."""
    try:
        value = float(text)
    except ValueError:
        raise ArgumentError(f"{prefix} {text!r} is not a number") from None
    if not math.isfinite(value):  # float() turns '1e400' into inf: quote the text, not the float
        raise ArgumentError(f"{prefix} {text!r} is not a finite number")
    return value


def strength_text(text: str, where: str, what: str = "strength") -> float:
    """A strength as the user wrote it (`FILE:S` on the command line, `<lora:name:S>` in a prompt): one
    message for each way it is wrong, naming `where` it was written and the text itself."""
    value = _finite_text(text, f"{where}: {what}")
    if abs(value) > MAX_STRENGTH:
        raise ArgumentError(
            f"{where}: {what} {text!r} is out of range (absolute value at most {MAX_STRENGTH:g})"
        )
    return value


def parse_adapter_arg(spec: str) -> tuple[str, float]:
    """`FILE[:STRENGTH]`; a trailing `:number` is the strength (paths may contain ':' elsewhere). The strength
    follows AdapterSpec's rule (finite, |s| <= 1e4) with `arguments.strength_text`'s messages; a tail that is
    no number after an existing FILE (`lora.safetensors:abc`) is a bad strength, not part of the name."""
    head, sep, tail = spec.rpartition(":")
    if not (sep and head):
        return spec, 1.0
    try:
        float(tail)
    except ValueError:
        if Path(spec).exists() or not Path(head).exists():
            return spec, 1.0
    return head, strength_text(tail, head)


def integer_text(text: str, label: str, minimum: int = 1, maximum: int | None = None) -> int:
    """An integer as the user wrote it on the command line, in [minimum, maximum]: one message for each way
    it is wrong ('1e9' and '2.5' are numbers, but not written as integers)."""
    bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
    try:
        float(text)
    except ValueError:
        raise ArgumentError(f"{label}: {text!r} is not a number") from None
    if not text.strip().lstrip("+-").isdigit():
        raise ArgumentError(f"{label} must be an integer {bounds}, got {text!r}")
    value = int(text)
    if value < minimum or (maximum is not None and value > maximum):
        raise ArgumentError(f"{label} must be an integer {bounds}, got {value}")
    return value


def number_text(text: str, label: str, minimum: float, maximum: float, low_open: bool = False) -> float:
    """A finite number as the user wrote it on the command line, in [minimum, maximum] ((minimum, maximum]
    when `low_open`)."""
    value = _finite_text(text, f"{label}:")
    if not minimum <= value <= maximum or (low_open and value == minimum):
        interval = f"{'(' if low_open else '['}{minimum:g}, {maximum:g}]"
        raise ArgumentError(f"{label} must be a number in {interval}, got {text!r}")
    return value


def positive_int(value: object, label: str, minimum: int = 1) -> int:
    """An int >= minimum (bools and floats refused)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or value < minimum:
        raise ArgumentError(f"{label} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def fraction(value: object, label: str, low_open: bool = True) -> float:
    """A finite number in (0, 1] (or [0, 1] when `low_open` is False)."""
    value = number(value, label)
    if value > 1 or value < 0 or (low_open and value == 0):
        raise ArgumentError(f"{label} must be in {'(' if low_open else '['}0, 1], got {value!r}")
    return value


def non_negative(value: object, label: str) -> float:
    value = number(value, label)
    if value < 0:
        raise ArgumentError(f"{label} must be >= 0, got {value!r}")
    return value


def byte_size(value: object, label: str, allow_zero: bool = False) -> int:
    """Bytes from an int or a string: "1GB" / "1G" (10^9), "1GiB" (2^30), "512MiB", "2e9"; > 0 unless
    `allow_zero`."""
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m is None:
            raise ArgumentError(
                f"{label} must be bytes (an int) or a size such as '8GB', '512MiB', got {value!r}"
            )
        base = 1024 if m[3] else 1000
        size = float(m[1]) * base ** _POWERS[m[2].lower()]
        if not math.isfinite(size):
            raise ArgumentError(f"{label} must be a finite size, got {size!r}")
        value = int(size)
    if (
        isinstance(value, bool)
        or not isinstance(value, Integral)
        or value < 0
        or (value == 0 and not allow_zero)
    ):
        raise ArgumentError(
            f"{label} must be a {'non-negative' if allow_zero else 'positive'} number of bytes, got {value!r}"
        )
    return int(value)
