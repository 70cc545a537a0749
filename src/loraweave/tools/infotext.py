"""Generation metadata as A1111 writes it (`parameters` PNG text chunk) and the hashes it names.

Layout: `{prompt}\\nNegative prompt: {negative}\\n{K: V, K: V, ...}`; the prompt keeps its `<lora:...>` tags,
the negative line only when non-empty, None values skipped, a value holding `,`, `:` or a newline JSON-quoted.
`Model hash` is the first 10 hex of the checkpoint's sha256; `Lora hashes` the first 12 hex of each adapter's
AddNet hash (sha256 of the bytes after the safetensors header) or of its `sshs_model_hash` metadata."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path

CHUNK = 1 << 20


def quote(value: object) -> str:
    """A1111's rule: a value with `,`, `:` or a newline becomes a JSON string, anything else stays as is."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def _sha256(path: Path, skip: int = 0) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(skip)
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def model_hash(path: str | Path) -> str | None:
    """First 10 hex of the file's sha256; None for a folder (A1111 hashes single files only)."""
    path = Path(path)
    return _sha256(path)[:10] if path.is_file() else None


def addnet_hash(path: str | Path, metadata: Mapping[str, str] | None = None) -> str | None:
    """First 12 hex of the AddNet hash of a .safetensors adapter (or its `sshs_model_hash`); None otherwise."""
    if metadata and isinstance(metadata.get("sshs_model_hash"), str) and metadata["sshs_model_hash"]:
        return metadata["sshs_model_hash"][:12]
    path = Path(path)
    if not path.is_file() or path.suffix.lower() != ".safetensors":
        return None
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        return None
    return _sha256(path, skip=8 + struct.unpack("<Q", head)[0])[:12]


def lora_hashes(named: list[tuple[str, str | None]]) -> str | None:
    """`"alias: h12, alias2: h12"`, aliases without `:`/`,` (A1111 strips them); None when no hash is known."""
    items = [f"{name.replace(':', '').replace(',', '')}: {h}" for name, h in named if h]
    return ", ".join(items) if items else None


def infotext(prompt: str, negative: str, params: Mapping[str, object]) -> str:
    """The `parameters` text: prompt, optional negative line, then `K: V` pairs in the given order."""
    pairs = ", ".join(f"{k}: {quote(v)}" for k, v in params.items() if v is not None)
    negative_line = f"\nNegative prompt: {negative}" if negative else ""
    return f"{prompt}{negative_line}\n{pairs}".strip()


def parse_infotext(text: str) -> tuple[str, str, dict[str, str]]:
    """(prompt, negative, params) back from `infotext` (JSON-quoted values unquoted); for tests and readers."""
    lines = text.split("\n")
    params_line = lines.pop() if lines else ""
    negative = ""
    if lines and lines[-1].startswith("Negative prompt: "):
        negative = lines.pop()[len("Negative prompt: ") :]
    params: dict[str, str] = {}
    rest = params_line
    while rest:
        key, _, rest = rest.partition(": ")
        if rest.startswith('"'):
            value, end = json.JSONDecoder().raw_decode(rest)
            rest = rest[end:]
        else:
            value, _, rest = rest.partition(", ")
            rest = ", " + rest if rest else ""
        params[key.strip()] = value
        rest = rest.removeprefix(", ")
    return "\n".join(lines), negative, params
