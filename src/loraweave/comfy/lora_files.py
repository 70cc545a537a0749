"""LoRA files as the nodes name them: a `lora_name` in ComfyUI's "loras" folders, never a path outside them;
queue-time checks, cache fingerprints, and what LoraWeave Inspect shows (loraweave's inspect, trigger words
and heatmap). ComfyUI's `folder_paths` is imported inside the functions, as every part of `loraweave.comfy`
does."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path, PurePosixPath, PureWindowsPath

from ..errors import ArgumentError, LoraweaveError
from ..io.file_cache import file_identity

log = logging.getLogger("loraweave")

FOLDER = "loras"
NONE = "None"  # the stack row's "no LoRA" choice (the LORA_STACK packs' convention)
NO_HEATMAP = 64  # side of the black IMAGE Inspect outputs where no heatmap can be drawn


def lora_choices(with_none: bool = False) -> list[str]:
    import folder_paths

    return ([NONE] if with_none else []) + folder_paths.get_filename_list(FOLDER)


def lora_path(name: str) -> str:
    """The file `name` stands for in the loras folders; ArgumentError for an absolute name, a `..` part, or a
    name no folder holds (the message names the name and the folders)."""
    import folder_paths

    if not isinstance(name, str) or not name.strip() or name == NONE:
        raise ArgumentError(f"lora_name {name!r}: no LoRA file chosen")
    for pure in (PurePosixPath(name), PureWindowsPath(name)):
        if pure.is_absolute() or pure.drive or ".." in pure.parts:
            raise ArgumentError(
                f"lora_name {name!r}: refused: a name inside ComfyUI's {FOLDER} folders is expected, "
                "not an absolute path or one with '..'"
            )
    path = folder_paths.get_full_path(FOLDER, name)
    if path is None:
        folders = ", ".join(folder_paths.get_folder_paths(FOLDER))
        raise ArgumentError(f"lora_name {name!r}: no such file in ComfyUI's {FOLDER} folders ({folders})")
    return path


def validation_message(name: str) -> bool | str:
    """True, or why `name` cannot be loaded (ComfyUI shows the string at queue time): a refused or missing
    name, or a .safetensors file whose header is broken."""
    from ..io.safetensors_file import read_safetensors_header

    try:
        path = lora_path(name)
        if path.lower().endswith(".safetensors"):
            read_safetensors_header(path)
    except (LoraweaveError, OSError) as exc:
        return str(exc)
    return True


def file_fingerprint(name: str) -> str:
    """Changes whenever the file's bytes may have (io.file_cache.file_identity, the key the loader's cache of
    parsed files uses), so ComfyUI re-runs the node for a file rewritten under that name."""
    try:
        identity = file_identity(lora_path(name))
    except LoraweaveError:
        identity = None
    if identity is None:
        return f"unresolved:{name}"  # validation reports it; no fingerprint to take
    return f"{name}:" + ":".join(str(v) for v in identity[1:])


def inspect_text(path: str, lora_name: str, model=None, clip=None) -> str:
    """loraweave inspect's table of the file (layout, families, ranks, detected architecture and variant,
    coverage), the file named as the node names it (no server path) and without the CLI's flags. Coverage is
    judged against the full-size model of the detected architecture, or, given a ComfyUI MODEL, against that
    model's own modules by the loader's resolver (a LoRA for a pruned, distilled or tiny model lands there),
    its text-encoder keys on `clip` when one is given and skipped otherwise (model-only). The architecture and
    variant are the file's either way (a UNet named by the shapes that fit)."""
    from ..tools.inspect import format_table, inspect_adapter

    info = inspect_adapter(path)
    info["path"] = lora_name
    if model is not None:
        info["coverage"] = model_coverage(model, path, clip)
    elif clip is not None:
        info["coverage"]["note"] = CLIP_WITHOUT_MODEL
    return format_table(info, more=None)


CLIP_WITHOUT_MODEL = (
    "the CLIP is judged only with a MODEL connected: this coverage is on the full-size model of the file's "
    "architecture"
)


def model_coverage(model, path: str, clip=None) -> dict:
    """inspect's coverage entry for `path` on a ComfyUI MODEL (and CLIP): the loader's plan (api.judge).
    Without `clip` the text-encoder keys are skipped, as the model-only loader skips them, and counted apart
    (`keys_skipped`, `skipped_by_component`)."""
    from collections import Counter

    from ..report.report import failures
    from .api import judge
    from .targets import comfy_arch, comfy_model_name, reference_or_why

    report = judge(model, path, clip)  # a TargetError naming the input where `model` is no diffusion MODEL
    arch = comfy_arch(model) or comfy_model_name(model)
    unmatched = [{"key": u.key, "reason": u.reason, "kind": u.kind} for u in report.unmatched]
    return {
        "checked": True,
        "against": f"the connected MODEL ({arch}, its own modules){' and CLIP' if clip is not None else ''}",
        "note": reference_or_why(model)[1],  # why some layouts cannot be judged on this MODEL, or None
        "keys_total": report.keys_total,
        "keys_applied": report.keys_applied,
        "keys_skipped": report.keys_skipped,
        "skipped_by_component": report.skipped_by_component(),
        "unmatched": unmatched,
        "unmatched_by_kind": dict(Counter(u["kind"] for u in unmatched)),
        "alpha_sources": report.adapters[0]["alpha_sources"] if report.adapters else {},
        "complete": not failures(unmatched),
    }


def trigger_text(path: str) -> str:
    """The trigger words (modelspec.trigger_phrase, then the most frequent ss_tag_frequency tags),
    comma-joined."""
    from ..formats.adapter import load_adapter
    from ..io.safetensors_file import read_safetensors_header
    from ..tools.inspect_dir import trigger_words

    if path.lower().endswith(".safetensors"):
        metadata = read_safetensors_header(path)[1]
    else:
        metadata = load_adapter(path).metadata
    return ", ".join(trigger_words(metadata))


def heatmap_image(path: str):
    """(`loraweave inspect --plot`'s heatmap as a ComfyUI IMAGE: float32 [1, H, W, 3] in 0..1, None), or (a
    black NO_HEATMAP-sized IMAGE, why none was drawn) for a file that resolves on no full-size model (an
    architecture loraweave does not know)."""
    import numpy as np
    import torch
    from PIL import Image

    from ..tools.heatmap import render
    from ..tools.plot import NoModelToDrawOnError, block_grid

    try:
        grid = block_grid(path)
    except NoModelToDrawOnError as exc:
        return torch.zeros(1, NO_HEATMAP, NO_HEATMAP, 3), f"heatmap: not drawn ({exc})"
    with tempfile.TemporaryDirectory(prefix="loraweave-heatmap-") as tmp:
        png = Path(tmp) / "heatmap.png"
        render(grid, png)
        with Image.open(png) as img:
            pixels = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    return torch.from_numpy(pixels.copy())[None], None
