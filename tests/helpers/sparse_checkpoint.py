"""Full-size checkpoints with real tensor names and shapes but no data: a safetensors header over a sparse
file (a few hundred KiB on disk), for tests that only plan against a checkpoint (names and shapes, no
values)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import yaml

# sd-mecha key lists give fp32; fp16 halves the (sparse) size and is what released checkpoints hold.
_DTYPES = {"float32": ("F16", 2), "float16": ("F16", 2), "int64": ("I64", 8)}


def sparse_checkpoint(key_list: Path, out: Path) -> Path:
    """Write `out` with every non-optional tensor of an sd-mecha model-config yaml, in its order."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    data = yaml.load(key_list.read_text(), Loader=loader)
    header, offset = {}, 0
    for component in data["components"].values():
        for name, entry in component.items():
            if entry.get("optional"):
                continue
            code, size = _DTYPES[entry["dtype"]]
            length = math.prod(entry["shape"]) * size
            header[name] = {"dtype": code, "shape": entry["shape"], "data_offsets": [offset, offset + length]}
            offset += length
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with out.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return out


def sparse_module_file(module, out: Path) -> Path:
    """Write `out` with every parameter and buffer of `module` (meta is fine) under its own name, fp16."""
    header, offset = {}, 0
    for name, tensor in module.state_dict().items():
        code, size = ("F16", 2) if tensor.dtype.is_floating_point else ("I64", 8)
        length = tensor.numel() * size
        header[name] = {"dtype": code, "shape": list(tensor.shape), "data_offsets": [offset, offset + length]}
        offset += length
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return out
