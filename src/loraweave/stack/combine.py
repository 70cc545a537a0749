"""Combine several adapters' dense ΔW on one layer: sum, TIES, DARE (linear / TIES), magnitude prune.

Semantics follow PEFT's `peft.utils.merge_utils` (the reference the tests compare against), applied to the
dense deltas rather than to the A and B factors separately:
- magnitude prune: keep the `int(density·numel)` largest |Δ| of each adapter, zero the rest (entries tied
  at the threshold are kept in index order; PEFT's topk leaves that order unspecified);
- DARE: keep each entry with probability `density`, rescale the kept ones by 1/density;
- TIES sign election: the sign of the sum of the *pruned, unweighted* deltas (ties at 0 count as +);
  disjoint merge: mean over the adapters whose pruned entry has the elected sign, of `strength·Δ`;
- `*_linear` / magnitude prune: the strength-weighted sum of the pruned deltas.
DARE masks come from a local generator seeded by a hash of (key, mode, density): the same layer, adapters
and settings always give the same masks, and the caller's global RNG is never read or advanced."""

from __future__ import annotations

import hashlib
import logging
import math

import torch
from torch import Tensor

from ..errors import ArgumentError
from ..modes import DENSE_MODES, SELECT_MODES, STACK_MODES

log = logging.getLogger("loraweave")


def validate_stack(mode: str, density: float | None, n_adapters: int | None = None) -> None:
    """Raise ValueError when `mode`/`density` (and, for select modes, the adapter count) do not fit
    together."""
    if mode not in STACK_MODES:
        raise ArgumentError(f"unknown stack mode {mode!r}; expected one of {', '.join(STACK_MODES)}")
    if mode in DENSE_MODES:
        if density is None:
            raise ArgumentError(
                f"stack={mode!r} needs density= (the fraction of entries kept, 0 < density <= 1)"
            )
        if isinstance(density, bool) or not isinstance(density, (int, float)) or not math.isfinite(density):
            raise ArgumentError(f"density must be a finite number in (0, 1], got {density!r}")
        if not 0.0 < float(density) <= 1.0:
            raise ArgumentError(f"density must be in (0, 1] for stack={mode!r}, got {density}")
    elif density is not None:
        raise ArgumentError(f"density= only applies to {', '.join(DENSE_MODES)}; stack={mode!r} takes none")
    if mode in SELECT_MODES and n_adapters is not None and n_adapters != 2:
        raise ArgumentError(f"stack={mode!r} needs exactly two adapters (subject, style), got {n_adapters}")


def mask_seed(key: str, mode: str, density: float) -> int:
    """64-bit seed for the DARE masks of one layer: sha256 of key, mode and density (repr, so 0.5 !=
    0.50001)."""
    digest = hashlib.sha256(f"{key}|{mode}|{float(density)!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def dare_masks(shape: tuple[int, ...], count: int, density: float, key: str, mode: str) -> list[Tensor]:
    """`count` Bernoulli(density) keep-masks (fp32, CPU), drawn in adapter order from one seeded local
    generator.

    Drawing them as `torch.bernoulli(full(shape, density))` from a generator seeded with `mask_seed(...)` is
    the same stream PEFT's `random_pruning` draws from the global RNG after `torch.manual_seed(seed)`."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(mask_seed(key, mode, density))
    probs = torch.full(tuple(shape), float(density), dtype=torch.float32)
    # CPU generation keeps masks identical whatever device the deltas live on.
    return [torch.bernoulli(probs, generator=gen) for _ in range(count)]


def _magnitude_prune(delta: Tensor, density: float) -> Tensor:
    """Keep the k = int(density·numel) largest |Δ| (PEFT's rule), via a k-th value threshold (faster than
    topk)."""
    if density >= 1.0:
        return delta
    flat = delta.reshape(-1)
    k = int(density * flat.numel())
    if k == 0:
        return torch.zeros_like(delta)
    mag = flat.abs()
    thresh = torch.kthvalue(mag, flat.numel() - k + 1).values
    keep = mag > thresh
    ties = mag == thresh
    room = k - int(torch.count_nonzero(keep))
    # Entries equal to the threshold fill the remaining places in index order, so exactly k survive.
    if room >= int(torch.count_nonzero(ties)):
        keep |= ties
    elif room > 0:
        keep[torch.nonzero(ties).flatten()[:room]] = True
    return (flat * keep).reshape(delta.shape)


def _disjoint_mean(pruned: Tensor, weights: Tensor) -> Tensor:
    """TIES: elect the sign of the summed pruned deltas, average the weighted entries that agree with it."""
    elected = torch.where(pruned.sum(dim=0) >= 0, 1.0, -1.0)
    agree = pruned.sign() == elected
    weighted = pruned * weights
    kept = agree.sum(dim=0).clamp(min=1)
    return (weighted * agree).sum(dim=0) / kept


def _check_inputs(deltas: list[Tensor], weights: list[float]) -> None:
    if not deltas:
        raise ValueError("combine_deltas needs at least one delta")
    if len(weights) != len(deltas):
        raise ValueError(f"got {len(deltas)} deltas but {len(weights)} weights")
    shape = tuple(deltas[0].shape)
    for i, d in enumerate(deltas):
        if tuple(d.shape) != shape:
            raise ValueError(
                f"delta {i} has shape {tuple(d.shape)}, delta 0 has {shape}: one layer, one shape"
            )
    for w in weights:
        if not math.isfinite(float(w)):
            raise ValueError(f"weights must be finite, got {weights}")


def combine_deltas(
    deltas: list[Tensor],
    weights: list[float],
    mode: str,
    density: float | None,
    key: str,
    *,
    choice: int | None = None,
) -> Tensor:
    """One layer's combined ΔW (fp32) from each adapter's dense ΔW and strength.

    `key` names the layer, the adapters and anything else that should change the DARE masks; it must be the
    same string on every re-apply of the same set, and differ between layers. Select modes (klora/estlora)
    do not mix deltas: pass `choice` (0 = subject, 1 = style, from SelectSchedule) to get that adapter's
    weighted delta."""
    validate_stack(mode, density, len(deltas) if mode in ("klora", "estlora") else None)
    _check_inputs(deltas, weights)
    if mode == "sum":
        out = deltas[0].float() * float(weights[0])
        for d, wt in zip(deltas[1:], weights[1:], strict=True):
            out.add_(d.float(), alpha=float(wt))
        return out
    stacked = torch.stack([d.float() for d in deltas], dim=0)
    w = torch.tensor([float(x) for x in weights], dtype=torch.float32, device=stacked.device)
    w = w.view((-1,) + (1,) * (stacked.dim() - 1))
    if mode in SELECT_MODES:
        if choice not in (0, 1):
            raise ValueError(
                f"stack={mode!r} picks one adapter per layer and step: pass choice=0 or 1 "
                f"(see SelectSchedule), got {choice!r}"
            )
        return stacked[choice] * w[choice]
    assert density is not None  # validate_stack guarantees it
    if mode in ("ties", "magnitude_prune"):
        pruned = torch.stack([_magnitude_prune(d, float(density)) for d in stacked], dim=0)
    else:
        masks = dare_masks(tuple(stacked.shape[1:]), len(deltas), float(density), key, mode)
        mask = torch.stack(masks, dim=0).to(stacked.device)
        pruned = stacked * mask / float(density)
    log.debug("stack_combine mode=%s density=%s adapters=%d key=%s", mode, density, len(deltas), key)
    if mode in ("ties", "dare_ties"):
        return _disjoint_mean(pruned, w)
    return (pruned * w).sum(dim=0)
