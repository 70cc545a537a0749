"""Whether an output may be written where asked: the check every writer makes first, free of torch so the
CLI refuses a bad target before its heavy imports."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import WriteError


def check_output(
    target: str | os.PathLike,
    inputs: Sequence[str | os.PathLike],
    overwrite: bool = False,
    folder: bool = False,
) -> Path:
    """Refuse a target that is (or lies inside, or contains) an input, whose folder does not exist, of the
    other kind (a file where a folder is written, or the reverse), or that exists unless overwrite."""
    out = Path(target).resolve()
    for item in inputs:
        src = Path(item).resolve()
        if out == src or src.is_relative_to(out) or out.is_relative_to(src):
            raise WriteError(f"output {target} would overwrite input {item}")
    if not out.parent.is_dir():  # never create folders the user did not ask for (a typo can name '/')
        raise WriteError(f"output {target}: its folder does not exist (create it first)")
    if out.exists() and out.is_dir() != folder:
        want, found = ("a folder", "a file") if folder else ("a file", "a folder")
        raise WriteError(
            f"output {target} is {found}; this command writes {want} there (name another output)"
        )
    if out.exists() and not overwrite:
        raise WriteError(f"output {target} exists (pass --force to replace it)")
    return out


FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf", ".sft")


def check_folder_name(target: str | os.PathLike, why: str) -> None:
    """Refuse a folder output named as a single file (`-o baked.safetensors` for a pipeline): kohya and
    ComfyUI users would look for a file there and find a folder. `why`: what makes the output a folder."""
    suffix = Path(target).suffix
    if suffix.lower() in FILE_SUFFIXES:
        raise WriteError(
            f"output {target}: {why}, but {suffix} names a single file; name a folder (no {suffix})"
        )
