"""Offload hooks that own a layer's weight, seen from above the layer (a merge into such a layer lands in a
copy).

accelerate's offloading hooks (`cpu_offload`, `disk_offload`, `dispatch_model` to "cpu"/"disk") sit on the
layer itself and leave its weight on `meta`: `merge_blocker` sees those. diffusers' group offloading hooks sit
on a block (block_level) or a leaf (leaf_level) and keep the weight real at rest, so only the group tells
where it lives:
- `offload_to_disk_path`: every onload reads the group's safetensors file again (a merge would be lost,
  silently);
- a stream: onloads copy from pinned host copies made when the hooks were applied (a merge may miss them).
Groups that move the weight itself with `.to()` (no stream, no disk) carry a merge along and are not
listed."""

from __future__ import annotations

from collections.abc import Iterable

import torch

GROUP_HOOK = "group_offloading"  # diffusers.hooks.group_offloading._GROUP_OFFLOADING


def _group(module: torch.nn.Module) -> object | None:
    """diffusers' offload group holding the module (duck-typed: diffusers is optional), or None."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = getattr(registry, "hooks", {}).get(GROUP_HOOK) if registry is not None else None
    return getattr(hook, "group", None)


def _copy_reason(group: object) -> str | None:
    if getattr(group, "offload_to_disk_path", None):
        return (
            "diffusers group offloading reloads the weight from disk on every onload (a merge would be lost)"
        )
    if getattr(group, "stream", None) is not None:
        return "diffusers group offloading with streams onloads from pinned copies (a merge would miss them)"
    return None


def weight_copies(roots: Iterable[torch.nn.Module]) -> dict[int, str]:
    """id(module) -> why merging into it would write into a copy, for every layer a copying offload group
    owns."""
    out: dict[int, str] = {}
    for root in roots:
        for module in root.modules():
            group = _group(module)
            why = _copy_reason(group) if group is not None else None
            if why is None:
                continue
            for member in getattr(group, "modules", []):
                out.update((id(sub), why) for sub in member.modules())
            loose = {
                id(p) for p in getattr(group, "parameters", [])
            }  # a group's parameters outside its modules
            if loose:
                out.update(
                    (id(sub), why)
                    for sub in root.modules()
                    if any(id(p) in loose for p in sub.parameters(recurse=False))
                )
    return out
