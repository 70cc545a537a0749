"""Runtime-mode adapter paths on a streamed model: found on its layers, their device bytes counted in the
plan.

A path on a layer of a block travels with the block: its factors, cast to the layer's dtype, are part of the
block's slot layout, copied with its weights and bound to the path while the block computes. Paths elsewhere
(the rest of the model, or layers whose compute dtype is not known ahead: quantized storage) stay on the
device and are counted apart."""

from __future__ import annotations

import torch

from ..mechanisms.runtime.path import RuntimePath


def runtime_paths(module: torch.nn.Module, layers: list[torch.nn.Module] | None = None) -> list[RuntimePath]:
    """Every attached RuntimePath under `module` (fused forward or forward hook); `layers`: only look
    there."""
    out = []
    for m in layers if layers is not None else module.modules():
        owner = getattr(m.__dict__.get("forward"), "__self__", None)
        if isinstance(owner, RuntimePath):
            out.append(owner)
        out.extend(h for h in m._forward_hooks.values() if isinstance(h, RuntimePath))
    return out


def travel_dtype(path: RuntimePath) -> torch.dtype | None:
    """The dtype the path's factors are cast to when its layer computes, if known ahead (a float weight)."""
    weight = getattr(path.module, "weight", None)
    if path.down is not None and isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return weight.dtype
    return None


def path_bytes(path: RuntimePath) -> int:
    """Device bytes of a path's cast factors (down, up, scale), in the dtype its layer computes in.

    Quantized layers (non-float storage) are counted at fp32, the widest compute dtype they cast to."""
    down, up = path.down, path.up
    if down is None or up is None:  # both or neither: one rank-concatenated pair
        return 0
    dtype = travel_dtype(path)
    size = torch.empty(0, dtype=dtype).element_size() if dtype is not None else 4
    return (down.numel() + up.numel() + path.scale.numel()) * size


def scale_bytes(path: RuntimePath) -> int:
    """Device bytes of the path's per-rank scale vector (it never travels: strength changes re-cast only
    it)."""
    dtype = travel_dtype(path)
    return path.scale.numel() * (torch.empty(0, dtype=dtype).element_size() if dtype is not None else 4)


def bind(
    path: RuntimePath, device: torch.device, dtype: torch.dtype, down: torch.Tensor, up: torch.Tensor
) -> None:
    """Make the path use `down`/`up` (slot views) as its (device, dtype) cast: no cast of its own is made."""
    path.bind_factors(device, dtype, down, up)


def unbind(path: RuntimePath) -> None:
    """Forget any device cast (a slot view, or the path's own copy while its block was resident)."""
    path.unbind_factors()


def recast(module: torch.nn.Module) -> None:
    """Re-cast every path's factors to where its layer's weight lives now (frees device copies after
    release)."""
    for path in runtime_paths(module):
        path.warm()
