"""cloneofsimo (positional) files for tools that work without the real model (bake, resize).

Their keys say "the i-th injected Linear", an order only a model with the real classes defines. The parts are named
by the same resolver `apply` uses, run on the full-size skeleton of the architecture the file fits (meta device);
the copy that comes back carries ordinary module paths, which a checkpoint's shadow tree resolves by name."""

from __future__ import annotations

import copy
import dataclasses
import logging

import torch

from ..arch.aliases import PATH_PREFIX_ALIASES
from ..formats.adapter import Adapter

log = logging.getLogger("loraweave")


def has_positional(adapter: Adapter) -> bool:
    return any(p.layout == "cloneofsimo" for p in adapter.parts)


def file_spelling(root: torch.nn.Module, path: str) -> str:
    """`path` as files and checkpoints write it: CLIP layers under `text_model.`, which the skeleton's tree lacks
    on recent transformers releases (an ldm checkpoint's shadow tree keeps it; a live tree takes either)."""
    prefix = PATH_PREFIX_ALIASES.get(type(root).__name__)
    if prefix and not any(name.startswith(prefix) for name, _ in root.named_modules()):
        return prefix + path
    return path


def name_positional(adapter: Adapter, arch: str | None = None) -> Adapter:
    """A copy of `adapter` whose positional parts carry the module path they resolve to on `arch` (default: the
    UNet the file's shapes fit best); parts that do not resolve stay positional and are reported as misses."""
    if not has_positional(adapter):
        return adapter
    from ..resolve.planner import resolve
    from ..resolve.target import Components
    from .inspect import _shape_only, adapter_target

    components, against, _ = adapter_target(adapter, arch, None)
    if components is None:
        return adapter
    plan = resolve(Components(components), [(_shape_only(adapter), 1.0)])
    named = {
        id(pp.part): file_spelling(components[pp.component], pp.pieces[0].module)
        for pp in plan.planned
        if pp.part.layout == "cloneofsimo" and len(pp.pieces) == 1
    }
    out = copy.copy(adapter)
    out.parts = [
        dataclasses.replace(p, path=named[id(p)], layout="diffusers") if id(p) in named else p
        for p in adapter.parts
    ]
    log.info(
        "positional file=%s named=%d/%d against=%s",
        adapter.name,
        len(named),
        sum(p.layout == "cloneofsimo" for p in adapter.parts),
        against,
    )
    return out
