"""Merge: add every contribution into the weight, fp32-accumulated and rounded once; undo is bit-exact."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..arch.spec import Piece
from ..contribution import add_contribution, bias_of, coefficient
from ..errors import NonFiniteResultError
from ..plan.resolve import PlannedPart
from ..plan.stacking import adapter_names

Contribution = tuple[PlannedPart, Piece]
STACK_ATTR = "_loraweave_merges"  # per-module list of live merges, newest last


def merge_blocker(module: torch.nn.Module, needs_bias: bool = False) -> str | None:
    """Why merging into this module's weight would be lossy or impossible, or None when it is exact."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return "module has no weight"
    if needs_bias and getattr(module, "bias", None) is None:
        return "adapter carries a bias delta but the module has no bias"
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        return f"weight is a {type(weight).__name__} (quantized or wrapped storage)"
    if not weight.is_floating_point():
        return f"weight dtype {weight.dtype} is not floating point"
    if weight.device.type == "meta":
        return "weight is offloaded (meta device)"
    if getattr(module, "_loraweave_streamed", False):
        return "layer is streamed (its weight is copied in per forward; merging would touch only the copy)"
    hook = getattr(module, "_hf_hook", None)
    if hook is not None and (getattr(hook, "offload", False) or getattr(hook, "weights_map", None) is not None):
        return "accelerate offload hook owns the weight"
    return None


@dataclass(eq=False)  # identity semantics: instances are compared with `is` on the per-module stack
class MergedModule:
    module: torch.nn.Module
    contributions: list[Contribution]
    weight_backup: torch.Tensor
    bias_backup: torch.Tensor | None = None
    adapters: set[str] = field(default_factory=set)

    def is_top(self) -> bool:
        """Only the latest merge on a module can be undone exactly (each backup holds the earlier merges)."""
        stack = getattr(self.module, STACK_ATTR, [])
        return bool(stack) and stack[-1] is self

    def restore(self) -> None:
        stack = getattr(self.module, STACK_ATTR, [])
        if any(m is self for m in stack):
            stack.remove(self)
        with torch.no_grad():
            self.module.weight.data.copy_(self.weight_backup)
            if self.bias_backup is not None:
                self.module.bias.data.copy_(self.bias_backup)

    undo = restore  # a journal entry

    def write(self, fresh: bool = False) -> None:
        """(Re)compute W = backup + Σ coeff·ΔW from the backup, so strength changes stay exact.

        fresh: the weight still equals the backup (first write), so the restoring copy is skipped."""
        weight = self.module.weight.data
        with torch.no_grad():
            if weight.dtype == torch.float32 and len(self.contributions) == 1 and weight.is_contiguous():
                rows = weight.view(weight.shape[0], -1)
                if not fresh:
                    rows.copy_(self.weight_backup.view_as(rows))
                pp, piece = self.contributions[0]
                target = rows[piece.dst_start : piece.dst_start + piece.length]
                self._add(target, pp, piece)
            else:
                acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # fp64 weights keep fp64
                acc = self.weight_backup.reshape(weight.shape[0], -1).to(acc_dtype, copy=True)
                for pp, piece in self.contributions:
                    self._add(acc[piece.dst_start : piece.dst_start + piece.length], pp, piece)
                weight.copy_(acc.view(weight.shape))
            refuse_non_finite(weight, self.weight_backup, self.adapters)
            self._write_bias()

    def _add(self, target: torch.Tensor, pp: PlannedPart, piece: Piece) -> None:
        # The original rows, never the partly merged ones: contributions are independent and summed.
        add_contribution(target, pp, piece, self.weight_backup.reshape(self.weight_backup.shape[0], -1))

    def _write_bias(self) -> None:
        deltas = []
        live = getattr(self.module, "bias", None)
        original = self.bias_backup if self.bias_backup is not None else live  # before the first write: untouched
        for pp, piece in self.contributions:
            b = bias_of(pp, piece, original)
            if b is not None:
                deltas.append((piece, b, coefficient(pp)))
        if not deltas:
            return
        bias = self.module.bias
        if self.bias_backup is None:
            self.bias_backup = bias.detach().clone()
        acc = self.bias_backup.to(torch.promote_types(bias.dtype, torch.float32), copy=True)
        for piece, b, coeff in deltas:
            acc[piece.dst_start : piece.dst_start + piece.length].add_(b, alpha=coeff)
        bias.data.copy_(acc)


def refuse_non_finite(written: torch.Tensor, original: torch.Tensor, adapters: set[str]) -> None:
    """Raise when the merge made values non-finite that were finite (an overflowing product of finite factors)."""
    try:
        lo, hi = torch.aminmax(written)
        if math.isfinite(lo.item()) and math.isfinite(hi.item()):
            return
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax here: the elementwise test below
        pass
    new = ~torch.isfinite(written.float()) & torch.isfinite(original.view_as(written).float())
    if bool(new.any()):
        raise NonFiniteResultError(
            f"merging {', '.join(sorted(adapters)) or 'the adapters'} gives {int(new.sum())} non-finite values in a "
            f"{tuple(written.shape)} {written.dtype} weight (the delta overflows); the layer is left as it was")


def needs_bias(contributions: list[Contribution]) -> bool:
    return any(bias_of(pp, piece) is not None for pp, piece in contributions)


def merge_module(module: torch.nn.Module, contributions: list[Contribution], record) -> MergedModule:
    """Merge into `module`; the undo record goes to `record` (a list's append, or a journal's record) before the
    weight is touched."""
    if needs_bias(contributions) and getattr(module, "bias", None) is None:
        raise ValueError("adapter carries a bias delta but the module has no bias")
    merged = MergedModule(module, contributions, module.weight.detach().clone())
    merged.adapters = adapter_names(contributions)
    if not hasattr(module, STACK_ATTR):
        setattr(module, STACK_ATTR, [])
    getattr(module, STACK_ATTR).append(merged)
    (record.append if isinstance(record, list) else record)(merged)
    merged.write(fresh=True)
    return merged
