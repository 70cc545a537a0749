"""What a baked checkpoint says about itself: the `loraweave.baked` metadata entry (base, adapters with their
sha256 and strengths, dtype, tensors whose bits changed) in every output file and index.

The count of changed tensors is known only after the data is written, and the header comes first: the entry is
written with room for any count (trailing blanks, which JSON ignores) and rewritten in place, at the same
length, once every shard is done. No tensor is held twice and no shard is read back."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..io.write import WriteError
from ..resolve.planner import Plan

METADATA_KEY = "loraweave.baked"
COUNT_ROOM = 20  # blanks reserved in the entry: any count of tensors fits in 20 digits


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def adapter_records(plan: Plan, adapters: list[tuple[str, float]]) -> list[dict]:
    """Per adapter: file name, sha256, strength and keys applied (the result's and the metadata's record)."""
    return [
        {
            "file": Path(path).name,
            "sha256": file_sha256(adapter.path) if adapter.path else None,
            "strength": strength,
            "keys_total": adapter.keys_total,
            "keys_applied": sum(len(pp.part.keys) for pp in plan.planned if pp.adapter is adapter),
        }
        for adapter, (path, strength) in zip(plan.adapters, adapters, strict=True)
    ]


def provenance(model, records: list[dict], dtype: torch.dtype | None, tensors_changed: int = 0) -> str:
    """The entry's text, with COUNT_ROOM blanks after it so `with_count` can rewrite it at the same length."""
    from .. import __version__

    record = {
        "tool": "loraweave",
        "version": __version__,
        "base": Path(model).name,
        "adapters": records,
        "dtype": str(dtype).removeprefix("torch.") if dtype else "unchanged",
        "tensors_changed": tensors_changed,
    }
    return json.dumps(record, sort_keys=True) + " " * COUNT_ROOM


def with_count(entry: str, tensors_changed: int) -> str:
    """`entry` with its count replaced, padded with blanks to the same length."""
    record = json.loads(entry)
    record["tensors_changed"] = tensors_changed
    text = json.dumps(record, sort_keys=True)
    if len(text) > len(entry):
        raise WriteError(f"tensors_changed={tensors_changed} does not fit the room left in the metadata")
    return text.ljust(len(entry))


def rewrite_entry(path: Path, old: str, new: str) -> None:
    """Replace the metadata value `old` by `new` (same length) in the safetensors header of `path`, in place.
    The header is JSON from `io.write.build_header` (json.dumps' default escaping), so the value's bytes there
    are json.dumps(old)."""
    old_bytes, new_bytes = json.dumps(old).encode(), json.dumps(new).encode()
    if len(old_bytes) != len(new_bytes):
        raise WriteError(f"{path}: the new {METADATA_KEY} entry is not the old one's length")
    with open(path, "r+b") as f:
        length = int.from_bytes(f.read(8), "little")
        header = f.read(length)
        at = header.find(old_bytes)
        if at < 0 or header.find(old_bytes, at + 1) >= 0:
            raise WriteError(f"{path}: the {METADATA_KEY} entry is not in the header exactly once")
        f.seek(8 + at)
        f.write(new_bytes)
        f.flush()
        os.fsync(f.fileno())


def index_with_sizes(index_file: Path, dst: Path, shard_sizes: dict[str, int], extra: dict[str, str]) -> None:
    """A sharded component's index, rewritten with the baked shards' sizes and the entry."""
    data = json.loads(index_file.read_text())
    data.setdefault("metadata", {})
    data["metadata"]["total_size"] = sum(shard_sizes.values())
    data["metadata"].update(extra)
    dst.write_text(json.dumps(data, indent=2))
