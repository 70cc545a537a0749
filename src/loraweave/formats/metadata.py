"""Validation of the metadata loraweave reads: PEFT configs (`lora_adapter_metadata`, adapter_config.json),
kohya `ss_network_alpha`/`ss_network_args`, cloneofsimo's per-component class lists. A malformed field raises
AdapterMetadataError naming the file and the field; fields loraweave never reads are left alone."""

from __future__ import annotations

import json
import math
import re

from ..errors import AdapterMetadataError

ABSENT = ("", "None", "none", "null")  # how kohya writes an unset value
PEFT_NUMBERS = ("r", "lora_alpha")
PEFT_PATTERNS = ("alpha_pattern", "rank_pattern")


def _number(value: object, integral: bool = False) -> float | None:
    """A finite real (bool is no number); None when it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:  # ints too large for a float
        return None
    if not math.isfinite(out) or (integral and (out != int(out) or out < 0)):
        return None
    return out


def kohya_number(metadata: dict[str, str], field: str, source: str, value: object = None) -> float | None:
    raw = metadata.get(field) if value is None else value
    if raw is None or (isinstance(raw, str) and raw.strip() in ABSENT):
        return None
    if not isinstance(raw, (str, int, float)):  # a JSON list or object from ss_network_args
        raise AdapterMetadataError(source, field, f"is {raw!r}, not a number")
    try:
        out = float(raw)
    except (TypeError, ValueError, OverflowError):
        raise AdapterMetadataError(source, field, f"is {raw!r}, not a number") from None
    if not math.isfinite(out):
        raise AdapterMetadataError(source, field, f"is {raw!r}, not a finite number")
    return out


def kohya_args(metadata: dict[str, str], source: str) -> dict:
    raw = metadata.get("ss_network_args")
    if raw is None or raw.strip() in ABSENT:
        return {}
    try:
        args = json.loads(raw)
    except (ValueError, RecursionError):
        raise AdapterMetadataError(source, "ss_network_args", "is not valid JSON") from None
    if not isinstance(args, dict):
        raise AdapterMetadataError(
            source, "ss_network_args", f"is a JSON {type(args).__name__}, expected an object"
        )
    return args


def peft_config(metadata: dict[str, str], given: object, source: str) -> dict | None:
    """The PEFT config (adapter_config.json, else `lora_adapter_metadata`), checked field by field."""
    field = "adapter_config.json"
    config = given
    if config is None and metadata.get("lora_adapter_metadata"):
        field = "lora_adapter_metadata"
        try:
            config = json.loads(metadata["lora_adapter_metadata"])
        except (ValueError, RecursionError):
            raise AdapterMetadataError(source, field, "is not valid JSON") from None
    if config is None:
        return None
    if not isinstance(config, dict):
        raise AdapterMetadataError(source, field, f"is a JSON {type(config).__name__}, expected an object")
    for key, value in config.items():
        name = key.rsplit(".", 1)[-1]  # diffusers prefixes fields with the component ("transformer.r")
        where = f"{field}: {key}"
        if name in PEFT_NUMBERS and value is not None and _number(value, integral=name == "r") is None:
            raise AdapterMetadataError(
                source, where, f"is {value!r}, not a finite {'count' if name == 'r' else 'number'}"
            )
        if name == "use_rslora" and value is not None and not isinstance(value, bool):
            raise AdapterMetadataError(source, where, f"is {value!r}, not true/false")
        if name in PEFT_PATTERNS and value is not None:
            _check_patterns(value, name, source, where)
    return config


def _check_patterns(value: object, name: str, source: str, where: str) -> None:
    if not isinstance(value, dict):
        raise AdapterMetadataError(
            source, where, f"is a {type(value).__name__}, expected an object of pattern: value"
        )
    for pattern, number in value.items():
        try:
            re.compile(rf"(?:.*\.)?(?:{pattern})")
        except (re.error, RecursionError, OverflowError) as exc:
            raise AdapterMetadataError(
                source, where, f"holds an invalid regular expression {pattern!r} ({exc})"
            ) from None
        if _number(number, integral=name == "rank_pattern") is None:
            raise AdapterMetadataError(source, f"{where}.{pattern}", f"is {number!r}, not a finite number")


def cloneofsimo_classes(metadata: dict[str, str], component: str, source: str) -> tuple[str, ...] | None:
    """The ancestor classes lora_diffusion enumerated for `component` (a JSON list of class names), or
    None."""
    raw = metadata.get(component)
    if raw is None or raw == "":
        return None
    try:
        classes = json.loads(raw)
    except (ValueError, RecursionError):
        raise AdapterMetadataError(source, component, "is not valid JSON (a list of class names)") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise AdapterMetadataError(source, component, f"is {raw[:80]!r}, not a list of class names")
    return tuple(classes)
