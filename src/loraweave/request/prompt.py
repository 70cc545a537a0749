"""Prompt syntax: `<lora:name:1.0>`, `<lora:name:1.0:0.5>`, `<lora:name:1:lbw=PRESET>`, `<lyco:...>`.

Positional numbers are the denoiser strength, then the text-encoder strength (default: the denoiser's).
Named items: `te=`, `unet=` / `dit=` / `model=` (denoiser), `lbw=` (block weights: a preset name or a
comma-separated vector), `start=` / `end=` (the step window as fractions of the schedule, `AdapterSpec.steps`;
a missing end is 1, a missing start 0), `video=` / `audio=` / `cross=` (per-modality strengths of audio-video
models, `AdapterSpec.modality_strengths`). Names resolve to `.safetensors` files inside `lora_dir` only: by
relative path (`styles/ink`) or by file stem anywhere below it. `..`, absolute paths, NUL bytes, and symlinks
whose target leaves the folder are refused."""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..arguments import strength_text
from ..errors import ArgumentError, PromptAdapterError
from .spec import AdapterSpec

log = logging.getLogger("loraweave")

_TAG = re.compile(r"<(lora|lyco):([^<>]*)>", re.IGNORECASE)
_DENOISER_KEYS = ("unet", "dit", "model")
_MODALITY_KEYS = ("video", "audio", "cross")
_SUFFIX = ".safetensors"


def _number(text: str, tag: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PromptAdapterError(f"{tag}: {what} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise PromptAdapterError(f"{tag}: {what} {text!r} is not a finite number")
    return value


def _strength(text: str, tag: str, what: str = "strength") -> float:
    """A strength: the same messages as `FILE:S` on the command line (`arguments.strength_text`)."""
    try:
        return strength_text(text, tag, what)
    except ArgumentError as exc:
        raise PromptAdapterError(str(exc)) from None


def _unsafe_reason(name: str) -> str | None:
    if "\x00" in name:
        return "contains a NUL byte"
    if not name.strip():
        return "is empty"
    if name.startswith(("/", "\\")) or PureWindowsPath(name).drive or PurePosixPath(name).is_absolute():
        return "is an absolute path"
    parts = re.split(r"[\\/]", name)
    if ".." in parts:
        return "contains '..'"
    return None


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve(strict=True).relative_to(root)
    except (ValueError, OSError):
        return False
    return True


def _catalogue(root: Path) -> dict[str, list[Path]]:
    """stem -> files below root (not following directory symlinks: a linked folder may lead anywhere)."""
    found: dict[str, list[Path]] = {}
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for file in files:
            if file.lower().endswith(_SUFFIX):
                path = Path(dirpath) / file
                found.setdefault(path.name[: -len(_SUFFIX)], []).append(path)
    return found


def resolve_adapter_name(name: str, lora_dir: str | os.PathLike) -> Path:
    """The `.safetensors` file `name` designates inside `lora_dir`; PromptAdapterError if unsafe or
    unknown."""
    reason = _unsafe_reason(name)
    if reason:
        raise PromptAdapterError(f"adapter name {name!r} {reason}; names must stay inside {lora_dir}")
    root = Path(lora_dir).resolve(strict=True)
    rel = name.replace("\\", "/").strip()
    if rel.lower().endswith(_SUFFIX):
        rel = rel[: -len(_SUFFIX)]
    catalogue = _catalogue(root)
    if "/" in rel:
        candidates = [root / (rel + _SUFFIX)]
        candidates = [p for p in candidates if p.exists() or p.is_symlink()]
    else:
        candidates = catalogue.get(rel, [])
    if len(candidates) > 1:
        listing = ", ".join(sorted(str(p.relative_to(root)) for p in candidates))
        raise PromptAdapterError(
            f"adapter name {name!r} is ambiguous in {root}: {listing}; use the subfolder path"
        )
    if not candidates:
        import difflib  # only on the error path: keeps it out of `import loraweave`

        known = sorted(
            {str(p.relative_to(root))[: -len(_SUFFIX)] for ps in catalogue.values() for p in ps}
            | set(catalogue)
        )
        close = difflib.get_close_matches(rel, known, n=5, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else f"; {len(known)} adapters in the folder"
        raise PromptAdapterError(f"no adapter {name!r} in {root}{hint}")
    path = candidates[0]
    # The check is on the resolved target: a symlink (file or any folder on the way) must land inside root.
    if not _inside(path, root):
        raise PromptAdapterError(f"adapter {name!r} resolves outside {root} (symlink escape); refused")
    if not path.resolve().is_file():
        raise PromptAdapterError(f"adapter {name!r} in {root} is not a file")
    return path.resolve()


def _parse_tag(kind: str, body: str, lora_dir: str | os.PathLike) -> AdapterSpec:
    tag = f"<{kind}:{body}>"
    items = body.split(":")
    name = items[0].strip()
    positional, named = _items(items[1:], tag)
    strength, te = _strengths(positional, named, tag)
    lbw = _block_weights(named, tag)
    steps = _window(named, tag)
    modalities = {k: _strength(named[k], tag, f"{k}= strength") for k in _MODALITY_KEYS if k in named}
    path = resolve_adapter_name(name, lora_dir)
    return AdapterSpec(
        source=path,
        strength=strength,
        te_strength=te,
        block_weights=lbw,
        name=name,
        steps=steps,
        modality_strengths=modalities or None,
    )


def _items(items: list[str], tag: str) -> tuple[list[float], dict[str, str]]:
    """(positional strengths, named values by lower-case key): positional first, each key once."""
    positional: list[float] = []
    named: dict[str, str] = {}
    for item in items:
        item = item.strip()
        if "=" in item:
            key, _, value = item.partition("=")
            key = key.strip().lower()
            if key not in ("te", "lbw", "start", "end", *_DENOISER_KEYS, *_MODALITY_KEYS):
                raise PromptAdapterError(
                    f"{tag}: unknown item {key!r}; known: te=, unet=/dit=/model=, lbw=, start=, end=, "
                    "video=/audio=/cross="
                )
            if key in named or (key in _DENOISER_KEYS and any(k in named for k in _DENOISER_KEYS)):
                raise PromptAdapterError(f"{tag}: {key}= given twice")
            named[key] = value.strip()
        elif named:
            raise PromptAdapterError(f"{tag}: positional value {item!r} after a named one")
        else:
            positional.append(_strength(item, tag))
    return positional, named


def _strengths(positional: list[float], named: dict[str, str], tag: str) -> tuple[float, float | None]:
    """(denoiser strength, text-encoder strength or None), each given positionally or by name, not both."""
    if len(positional) > 2:
        raise PromptAdapterError(
            f"{tag}: at most two strengths (denoiser, text encoder), got {len(positional)}"
        )
    strength = positional[0] if positional else 1.0
    te = positional[1] if len(positional) > 1 else None
    for key in _DENOISER_KEYS:
        if key in named:
            if positional:
                raise PromptAdapterError(f"{tag}: denoiser strength given both positionally and as {key}=")
            strength = _strength(named[key], tag, f"{key}= strength")
    if "te" in named:
        if te is not None:
            raise PromptAdapterError(f"{tag}: text-encoder strength given both positionally and as te=")
        te = _strength(named["te"], tag, "te= strength")
    return strength, te


def _block_weights(named: dict[str, str], tag: str) -> str | list[float] | None:
    """`lbw=`: its numbers as a list (one number too), else a preset name; None when not given."""
    if "lbw" not in named:
        return None
    raw = named["lbw"]
    if not raw:
        raise PromptAdapterError(f"{tag}: lbw= is empty")
    return [_number(x, tag, "lbw value") for x in raw.split(",")] if "," in raw or _is_number(raw) else raw


def _window(named: dict[str, str], tag: str) -> tuple[float, float] | None:
    """`start=` / `end=` as a checked step window, or None when neither is given."""
    if "start" not in named and "end" not in named:
        return None
    start = _number(named["start"], tag, "start=") if "start" in named else 0.0
    end = _number(named["end"], tag, "end=") if "end" in named else 1.0
    if not 0.0 <= start < end <= 1.0:
        raise PromptAdapterError(
            f"{tag}: start= and end= must satisfy 0 <= start < end <= 1, got {start} and {end}"
        )
    return start, end


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_prompt(prompt: str, lora_dir: str | os.PathLike) -> tuple[str, list[AdapterSpec]]:
    """Strip `<lora:...>` / `<lyco:...>` tags from `prompt` and resolve each to an AdapterSpec, in order."""
    if not Path(lora_dir).is_dir():
        raise PromptAdapterError(f"lora_dir {lora_dir!r} is not a folder")
    specs = [_parse_tag(m.group(1).lower(), m.group(2), lora_dir) for m in _TAG.finditer(prompt)]
    clean = _TAG.sub(" ", prompt)
    clean = re.sub(r"[ \t]{2,}", " ", clean)
    clean = re.sub(r" +([,.;])", r"\1", clean).strip()
    log.info("parse_prompt adapters=%d names=%s", len(specs), [s.name for s in specs])
    return clean, specs
