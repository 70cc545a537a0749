"""Generation metadata as A1111 writes it (`parameters` PNG text chunk) and the hashes it names.

Layout: `{prompt}\\nNegative prompt: {negative}\\n{K: V, K: V, ...}`; the prompt keeps its `<lora:...>` tags,
the negative line only when non-empty, None values skipped, a value holding `,`, `:` or a newline JSON-quoted.
`Model hash` is the first 10 hex of the checkpoint's sha256 (a folder model: of its denoiser's weight files
end to end); `Lora hashes` the first 12 hex of each adapter's AddNet hash (sha256 of the bytes after the
safetensors header), computed from the file: a `sshs_model_hash` in its metadata may be a stale copy from the
file it was made from (a resize, a merge) and would link the image to that file."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("loraweave")
CHUNK = 1 << 20


def quote(value: object) -> str:
    """A1111's rule: a value with `,`, `:` or a newline becomes a JSON string, anything else stays as is."""
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if any(c in text for c in ",:\n") else text


def _feed(digest, path: Path, skip: int = 0) -> None:
    with open(path, "rb") as f:
        f.seek(skip)
        while block := f.read(CHUNK):
            digest.update(block)


def _sha256(path: Path, skip: int = 0) -> str:
    digest = hashlib.sha256()
    _feed(digest, path, skip)
    return digest.hexdigest()


def denoiser_files(folder: Path) -> list[Path]:
    """The weight files a folder model's hash covers: its denoiser's (`unet*/`, `transformer*/` of a pipeline
    folder, or the folder's own `*.safetensors` for a component folder), in path order."""
    found = sorted(folder.glob("unet*/*.safetensors")) + sorted(folder.glob("transformer*/*.safetensors"))
    return sorted(found) or sorted(folder.glob("*.safetensors"))


def _cached_sha256(files: list[Path]) -> str:
    """sha256 of the files' bytes end to end, remembered under the skeleton cache by (path, size, mtime)."""
    from .skeleton import cache_dir

    key = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files])
    folder = cache_dir()
    store = folder / "model-hashes.json" if folder is not None else None
    known: dict[str, str] = {}
    if store is not None and store.is_file():
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(store.read_text())
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    for file in files:
        _feed(digest, file)
    known[key] = digest.hexdigest()
    if store is not None:
        tmp = store.with_name(f".{store.name}.{os.getpid()}.tmp")
        try:
            store.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(known))
            os.replace(tmp, store)
        except OSError:  # a read-only cache only costs the next run a rehash
            tmp.unlink(missing_ok=True)
    return known[key]


def model_hash(path: str | Path) -> str | None:
    """First 10 hex of the sha256 of a single-file checkpoint (as A1111), or of a folder model's denoiser
    weight files end to end (`denoiser_files`); None when a folder holds none."""
    path = Path(path)
    files = [path] if path.is_file() else denoiser_files(path) if path.is_dir() else []
    return _cached_sha256(files)[:10] if files else None


def addnet_hash(path: str | Path, metadata: Mapping[str, str] | None = None) -> str | None:
    """First 12 hex of the AddNet hash of a .safetensors adapter, from its bytes; None for another file.

    A `sshs_model_hash` in `metadata` that disagrees is logged and not used (a stale copy of a source's)."""
    path = Path(path)
    if not path.is_file() or path.suffix.lower() != ".safetensors":
        return None
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        return None
    own = _sha256(path, skip=8 + struct.unpack("<Q", head)[0])[:12]
    claimed = str((metadata or {}).get("sshs_model_hash") or "")[:12]
    if claimed and claimed != own:
        log.info("lora_hash path=%s sshs_model_hash=%s file=%s used=file", path, claimed, own)
    return own


def lora_hashes(named: list[tuple[str, str | None]]) -> str | None:
    """`"alias: h12, alias2: h12"`, aliases without `:`/`,` (A1111 strips them); None when no hash is
    known."""
    items = [f"{name.replace(':', '').replace(',', '')}: {h}" for name, h in named if h]
    return ", ".join(items) if items else None


def infotext(prompt: str, negative: str, params: Mapping[str, object]) -> str:
    """The `parameters` text: prompt, optional negative line, then `K: V` pairs in the given order."""
    pairs = ", ".join(f"{k}: {quote(v)}" for k, v in params.items() if v is not None)
    negative_line = f"\nNegative prompt: {negative}" if negative else ""
    return f"{prompt}{negative_line}\n{pairs}".strip()


def parse_infotext(text: str) -> tuple[str, str, dict[str, str]]:
    """(prompt, negative, params) back from `infotext` (JSON-quoted values unquoted); for tests and
    readers."""
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
