"""Registry of quantized-weight backends: which backend owns a layer, and which cannot run on this machine.

Backend modules are imported defensively: a module that fails to import is reported, never fatal."""

from __future__ import annotations

import importlib
import logging

import torch

from .backend import Capabilities, QuantBackend, Restore, reused_branches

log = logging.getLogger("loraweave")

_MODULES = ("sdnq", "bnb", "torchao", "quanto", "gguf", "nunchaku", "comfy_kitchen", "comfy_gguf")
BACKENDS: dict[str, QuantBackend] = {}
BROKEN: dict[str, str] = {}  # backend module -> why it could not be imported


def _load() -> None:
    for name in _MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # that backend module is not part of this build
            BROKEN[name] = f"import failed: {exc}"
            continue
        except Exception as exc:  # noqa: BLE001 - a broken optional backend must not break loraweave
            BROKEN[name] = f"import failed: {type(exc).__name__}: {exc}"
            continue
        backend = getattr(module, "BACKEND", None)
        if isinstance(backend, QuantBackend):
            BACKENDS[backend.name] = backend
        else:
            BROKEN[name] = "module defines no BACKEND"


_load()


def backend_for(module: torch.nn.Module) -> QuantBackend | None:
    """The backend whose quantized layer `module` is, or None for an ordinary layer."""
    for backend in BACKENDS.values():
        try:
            if backend.owns(module):
                return backend
        except Exception as exc:  # noqa: BLE001 - ownership probes must stay cheap and never raise
            log.debug("quant_probe backend=%s error=%r", backend.name, exc)
    return None


def broken() -> dict[str, str]:
    """{backend module: why it failed to import}."""
    return dict(BROKEN)


def unavailable() -> dict[str, str]:
    """{backend: why it cannot run here} for every known backend that cannot (package missing, no kernels)."""
    out = dict(BROKEN)
    for name, backend in BACKENDS.items():
        reason = backend.unavailable()
        if reason:
            out[name] = reason
    return out


__all__ = [
    "BACKENDS",
    "Capabilities",
    "QuantBackend",
    "Restore",
    "backend_for",
    "broken",
    "reused_branches",
    "unavailable",
]
