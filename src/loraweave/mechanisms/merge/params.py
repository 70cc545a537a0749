"""Patches of bare parameters (modulation tables): merged into the parameter, or substituted at runtime.

Both forms compute the same value, (P.fp32 + Σ strength·ΔP).to(P.dtype), so merged and runtime outputs agree
bit-exactly. Merge keeps a backup and restores it exactly (undo); the last merge on a parameter must be undone
first, as for module merges. Runtime swaps the patched tensor in for the owning module's forward only (a
pre-hook puts it in, an always-called post-hook puts the parameter back), so the stored parameter never
changes. Each patch has the undo interface of the module records (`restore`/`detach`,
`write`/`refresh_scales`, `adapters`, `is_top`), so a handle treats it like any other layer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, TypedDict

import torch
from torch.utils.hooks import RemovableHandle

from ...errors import ArgumentError
from ...resolve.params import PlannedParam

STACK_ATTR = "_loraweave_param_merges"  # per-owner {parameter name: live merges, newest last}


class AppliedParam(TypedDict):
    """A report row of one patched parameter (AppliedModule fields)."""

    component: str
    module: str
    mechanism: Literal["merge", "runtime"]
    adapters: list[str]
    why: str
    notes: list[str]


def merge_blocker(param: torch.Tensor) -> str | None:
    if type(param) not in (torch.Tensor, torch.nn.Parameter) or not param.is_floating_point():
        return f"parameter is a {type(param).__name__} of dtype {param.dtype}"
    if param.device.type == "meta":
        return "parameter is offloaded (meta device)"
    return None


class ParamPatch:
    def __init__(self, owner: torch.nn.Module, name: str, parts: list[PlannedParam]) -> None:
        self.module = owner
        self.name = name
        self.parts = parts
        self.adapters = {pp.adapter.name for pp in parts}
        self.backup: torch.Tensor | None = None
        self._hooks: list[RemovableHandle] = []
        self._saved: list[torch.Tensor] = []  # parameters swapped out during a forward

    def value(self, base: torch.Tensor) -> torch.Tensor:
        acc = base.detach().to(torch.promote_types(base.dtype, torch.float32), copy=True)
        for pp in self.parts:
            acc.add_(pp.delta.to(device=acc.device, dtype=acc.dtype), alpha=pp.strength * pp.scale)
        return acc.to(base.dtype)

    # merge --------------------------------------------------------------------------------------------
    def merge(self) -> None:
        param = getattr(self.module, self.name)
        self.backup = param.detach().clone()  # set first: from here on, undo restores
        stacks = self.module.__dict__.setdefault(STACK_ATTR, {})
        stacks.setdefault(self.name, []).append(self)
        self.write()

    def is_top(self) -> bool:
        stack = self.module.__dict__.get(STACK_ATTR, {}).get(self.name, [])
        return self.backup is None or (bool(stack) and stack[-1] is self)

    def write(self) -> None:
        backup = self.backup
        assert backup is not None, "write() runs only on a merged patch (merge() set the backup)"
        with torch.no_grad():
            getattr(self.module, self.name).copy_(self.value(backup))

    def restore(self) -> None:
        stack = self.module.__dict__.get(STACK_ATTR, {}).get(self.name, [])
        if any(m is self for m in stack):
            stack.remove(self)
        with torch.no_grad():
            getattr(self.module, self.name).copy_(self.backup)

    # runtime ------------------------------------------------------------------------------------------
    def attach(self) -> None:
        self._hooks = [
            self.module.register_forward_pre_hook(self._swap_in),
            # prepend + always_call: patches stacked on one parameter put back in reverse order, even on
            # errors
            self.module.register_forward_hook(self._swap_out, prepend=True, always_call=True),
        ]

    def _swap_in(self, module: torch.nn.Module, args: object) -> None:
        # torch types _parameters' values as optional; a planned parameter (resolve found it) is a tensor
        current: torch.Tensor = module._parameters[self.name]  # type: ignore[assignment]
        self._saved.append(current)
        # a plain tensor stands in for the parameter during the forward, deliberately
        module._parameters[self.name] = self.value(current)  # type: ignore[assignment]

    def _swap_out(self, module: torch.nn.Module, args: object, output: object) -> None:
        if self._saved:
            module._parameters[self.name] = self._saved.pop()  # type: ignore[assignment]  # swap back, as above

    def refresh_scales(self) -> None:
        """Strengths are read at every forward: nothing is cached."""

    # journal ------------------------------------------------------------------------------------------
    def rewrite(self) -> None:
        """Bring the patch to the current strengths (merge: from the backup; runtime: read at each
        forward)."""
        if self.backup is not None:
            self.write()

    def undo(self) -> None:
        if self.backup is not None:
            self.restore()
        else:
            self.detach()

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        while self._saved:
            self.module._parameters[self.name] = self._saved.pop()  # type: ignore[assignment]  # as _swap_out


def apply_params(
    parts: list[PlannedParam],
    modules: dict[str, torch.nn.Module],
    mode: str,
    record: Callable[[ParamPatch], object],
) -> list[AppliedParam]:
    """Patch every planned parameter (one patch per parameter, all its adapters summed); each patch goes to
    `record` (the handle's journal) before the parameter is touched, so a rollback finds it. Returns the
    report rows (AppliedModule fields), one per parameter."""
    groups: dict[tuple[str, str], list[PlannedParam]] = {}
    for pp in parts:
        groups.setdefault((pp.component, pp.path), []).append(pp)
    applied: list[AppliedParam] = []
    for (component, path), group in groups.items():
        owner = modules[component].get_submodule(group[0].owner)
        patch = ParamPatch(owner, group[0].name, group)
        blocker = merge_blocker(getattr(owner, patch.name))
        mechanism: Literal["merge", "runtime"] = (
            "runtime" if mode == "runtime" or (mode == "auto" and blocker) else "merge"
        )
        if mechanism == "merge" and blocker:
            raise ArgumentError(f"mode='merge': cannot merge into {component}.{path}: {blocker}")
        record(patch)
        if mechanism == "merge":
            patch.merge()
        else:
            patch.attach()
        why = f"parameter: {blocker}" if mode == "auto" and blocker else ""
        applied.append(
            {
                "component": component,
                "module": path,
                "mechanism": mechanism,
                "adapters": sorted(patch.adapters),
                "why": why,
                "notes": sorted({n for pp in group for n in pp.notes}),
            }
        )
    return applied
