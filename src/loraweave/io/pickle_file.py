"""Opt-in reader for pickled state dicts (.pt/.ckpt/.bin/.pth)."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import torch

from loraweave.errors import AdapterFileError, AdapterFormatError, UnsafeFormatError


def unpickler_reason(exc: Exception) -> str:
    """What torch's weights-only unpickler objected to, without the advice around it (re-run with
    weights_only=False, allowlist the global): both would run the code the refusal kept out."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    m = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\.\s|\.$|\n|$)", text)
    if m:
        return m.group(1).strip()
    if "weights_only" in text or "safe_globals" in text:
        return "it holds objects the weights-only unpickler does not allow"
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def load_pickle_state_dict(path: str | os.PathLike, allow_pickle: bool) -> dict[str, torch.Tensor]:
    """Read a pickled {name: tensor} dict (or {"state_dict": {...}}); refuses unless allow_pickle."""
    path = Path(path)
    if not allow_pickle:
        raise UnsafeFormatError(
            f"{path}: this is a pickle file (.pt/.ckpt/.bin/.pth), and loading a pickle can run "
            "arbitrary code. Convert it to .safetensors, or opt in: "
            "loraweave.load_adapter(path, allow_pickle=True) reads it with torch.load(weights_only=True); "
            "pass that Adapter to apply().",
            path=path,
        )
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except pickle.UnpicklingError as e:
        raise AdapterFileError(
            f"{path}: torch.load(weights_only=True) refused it (it holds objects other than "
            f"tensors and plain containers, or is not a torch pickle): {unpickler_reason(e)}"
        ) from e
    except Exception as e:
        # torch.load surfaces corrupt archives as RuntimeError/EOFError/etc.; give one typed error.
        raise AdapterFileError(
            f"{path}: could not be read by torch.load: {type(e).__name__}: {unpickler_reason(e)}"
        ) from e

    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise AdapterFormatError(f"{path}: holds a {type(obj).__name__}, expected a dict of tensors")
    # Checkpoints often carry optimizer state, step counters, etc. next to the weights.
    tensors = {k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    if not tensors:
        raise AdapterFormatError(f"{path}: the dict holds no tensors (keys: {list(obj)[:10]})")
    return tensors
