"""`inspect DIR`: one row per adapter in a folder (architecture, layout, families, rank, coverage, trigger
words), all in one process: torch, the architecture skeletons and the planner load once for the whole folder.

Adapters are `.safetensors` files (and `.pt/.ckpt/.bin` with allow_pickle) at any depth, plus PEFT folders
(holding adapter_config.json), which count as one adapter each. A file that cannot be read becomes a row with
`error` (the typed loraweave error's message); the other rows are unaffected."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from pathlib import Path

from ..errors import LoraweaveError

log = logging.getLogger("loraweave")

SAFE = (".safetensors",)
PICKLE = (".pt", ".ckpt", ".bin", ".pth")
TRIGGERS = 10


def adapter_paths(folder: str | Path, allow_pickle: bool = False) -> tuple[list[Path], list[dict]]:
    """(adapters in sorted order, [{file, reason}] for files left out) below `folder` (symlinked folders are
    not followed: a link may lead anywhere, as in prompt name resolution)."""
    root = Path(folder)
    found: list[Path] = []
    left_out: list[dict] = []
    for dirpath, dirs, files in os.walk(root, followlinks=False):
        here = Path(dirpath)
        if "adapter_config.json" in files and here != root:
            found.append(here)
            dirs[:] = []
            continue
        dirs.sort()
        for name in sorted(files):
            lower = name.lower()
            if lower.endswith(SAFE) or (allow_pickle and lower.endswith(PICKLE)):
                found.append(here / name)
            elif lower.endswith(PICKLE):
                left_out.append(
                    {
                        "file": str((here / name).relative_to(root)),
                        "reason": "pickle file: pass --allow-pickle to read it",
                    }
                )
    return sorted(found, key=lambda p: str(p.relative_to(root))), left_out


def _counts(freq) -> Counter:
    counts: Counter = Counter()
    if isinstance(freq, dict):
        for tags in freq.values():
            if isinstance(tags, dict):
                counts.update(
                    {
                        str(t).strip(): int(n)
                        for t, n in tags.items()
                        if isinstance(n, (int, float)) and str(t).strip()
                    }
                )
    return counts


def trigger_words(metadata: dict[str, str], top: int = TRIGGERS) -> list[str]:
    """The most frequent training tags (kohya `ss_tag_frequency`, or `ss_datasets[*].tag_frequency`), most
    frequent first (ties by name); `modelspec.trigger_phrase` first when set. Unreadable metadata gives []."""
    out: list[str] = []
    phrase = metadata.get("modelspec.trigger_phrase")
    if isinstance(phrase, str) and phrase.strip():
        out.append(phrase.strip())
    counts: Counter = Counter()
    try:
        if "ss_tag_frequency" in metadata:
            counts = _counts(json.loads(metadata["ss_tag_frequency"]))
        elif "ss_datasets" in metadata:
            for dataset in json.loads(metadata["ss_datasets"]):
                counts += _counts({"d": dataset.get("tag_frequency")} if isinstance(dataset, dict) else None)
    except (ValueError, TypeError, AttributeError) as exc:
        log.info("trigger_words unreadable tag metadata: %s", exc)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return out + [t for t, _ in ranked if t not in out][: max(top - len(out), 0)]


def _main_rank(ranks: dict[str, int]) -> int | None:
    """The rank most parts have (ties: the larger)."""
    if not ranks:
        return None
    return int(max(ranks.items(), key=lambda kv: (kv[1], int(kv[0])))[0])


def _metadata(path: Path, allow_pickle: bool) -> dict[str, str]:
    """The file's metadata; a .safetensors file's header only (the adapter was parsed once already)."""
    from ..formats.adapter import load_adapter
    from ..io.safetensors_file import read_safetensors_header

    if path.is_file() and path.suffix.lower() == ".safetensors":
        return read_safetensors_header(path)[1]
    return load_adapter(path, allow_pickle=allow_pickle).metadata


def inspect_one(path: Path, root: Path, **kwargs) -> dict:
    """The `inspect FILE --json` object plus `file`, `rank`, `trigger_words`; or {file, path, error}."""
    from .inspect import inspect_adapter

    rel = str(path.relative_to(root))
    t0 = time.perf_counter()
    try:
        info = inspect_adapter(path, **kwargs)
        metadata = _metadata(path, kwargs.get("allow_pickle", False))
    except (LoraweaveError, ValueError, OSError) as exc:
        return {"file": rel, "path": str(path), "error": str(exc)}  # the message says what; no class name
    seconds = round(time.perf_counter() - t0, 3)  # the whole row, trigger words included
    return {
        "file": rel,
        **info,
        "rank": _main_rank(info["ranks"]),
        "trigger_words": trigger_words(metadata),
        "seconds": seconds,
    }


def inspect_folder(folder: str | Path, progress: bool = False, **kwargs) -> tuple[list[dict], list[dict]]:
    """(one object per adapter, files left out). kwargs go to `inspect_adapter` (arch, model, ...)."""
    from tqdm.auto import tqdm

    root = Path(folder)
    if not root.is_dir():
        raise LoraweaveError(f"{folder}: not a folder")
    paths, left_out = adapter_paths(root, kwargs.get("allow_pickle", False))
    from .skeleton import reuse

    t0 = time.perf_counter()
    with reuse():  # each architecture's skeleton and alias tables are built once for the whole folder
        rows = [
            inspect_one(p, root, **kwargs)
            for p in tqdm(paths, desc="inspect", unit="file", disable=not progress)
        ]
    log.info(
        "inspect_folder folder=%s adapters=%d errors=%d left_out=%d seconds=%.3f",
        folder,
        len(rows),
        sum("error" in r for r in rows),
        len(left_out),
        time.perf_counter() - t0,
    )
    return rows, left_out


def inspect_paths(paths: list[str], progress: bool = False, **kwargs) -> list[dict]:
    """One object per adapter path as a shell glob gives them (files or PEFT folders), each named as given;
    kwargs go to `inspect_adapter`."""
    from tqdm.auto import tqdm

    from .skeleton import reuse

    rows = []
    with reuse():  # as for a folder: each skeleton built once
        for text in tqdm(paths, desc="inspect", unit="file", disable=not progress):
            path = Path(text)
            rows.append({**inspect_one(path, path.parent, **kwargs), "file": text})
    return rows


def _families(row: dict) -> str:
    return ",".join(sorted(row["families"])) or "-"


def format_folder(rows: list[dict], left_out: list[dict], width: int = 48) -> str:
    """One line per adapter: file, architecture, layout, families, rank, keys landed, trigger words."""
    head = ("file", "arch", "layout", "families", "rank", "landed", "trigger words")
    table: list[tuple[str, ...]] = [head]
    for r in rows:
        if "error" in r:
            table.append((r["file"], "ERROR", r["error"].replace(f"{r['path']}: ", ""), "", "", "", ""))
            continue
        cov = r["coverage"]
        table.append(
            (
                r["file"],
                r["architecture"]["name"],
                r["layout"],
                _families(r),
                str(r["rank"] or "-"),
                f"{cov['keys_applied']}/{cov['keys_total']}",
                ", ".join(r["trigger_words"][:5]) or "-",
            )
        )
    table = [(row[0], *(c if len(c) <= width else c[: width - 3] + "..." for c in row[1:])) for row in table]
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1] for row in table
    ]
    lines += [f"left out {x['file']}: {x['reason']}" for x in left_out]
    errors = sum("error" in r for r in rows)
    lines.append(
        f"{len(rows)} adapters, {errors} unreadable, "
        f"{sum(1 for r in rows if 'error' not in r and r['coverage']['complete'])} with every key landing"
    )
    return "\n".join(lines)
