"""cloneofsimo (positional) files for tools that work without the real model (bake, resize).

Their keys say "the i-th injected Linear", an order only a model with the real classes defines. The parts are
named by the same resolver `apply` uses, run on the full-size skeleton of the architecture the file fits (meta
device); the copy that comes back carries ordinary module paths, which a checkpoint's shadow tree resolves by
name."""

from __future__ import annotations

import copy
import dataclasses
import logging

from ..arch.aliases import missing_file_prefix
from ..formats.adapter import Adapter

log = logging.getLogger("loraweave")


def has_positional(adapter: Adapter) -> bool:
    return any(p.layout == "cloneofsimo" for p in adapter.parts)


def name_positional(adapter: Adapter, arch: str | None = None) -> Adapter:
    """A copy of `adapter` whose positional parts carry the module path they resolve to on `arch` (default:
    the UNet the file's shapes fit best); parts that do not resolve stay positional and are reported as
    misses."""
    if not has_positional(adapter):
        return adapter
    from ..resolve.planner import resolve
    from ..resolve.target import Components
    from .target import adapter_target, shape_only

    components, against, _ = adapter_target(adapter, arch, None)
    if components is None:
        return adapter
    plan = resolve(Components(components), [(shape_only(adapter), 1.0)])
    # CLIP under `text_model.`, which the skeleton lacks on recent transformers (an ldm checkpoint's tree has
    # it)
    prefixes = {name: missing_file_prefix(root) for name, root in components.items()}
    named = {
        id(pp.part): prefixes[pp.component] + pp.pieces[0].module
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
