"""Hosting: a non-factorable delta truncated to low rank so it can ride a quantized layer's side channel.

Randomized truncated SVD with oversampling +64 and 8 power iterations, seeded locally (the caller's RNG state
is never touched), the trailing null energy below 1e-6 dropped; the captured energy is returned for the
report."""

from __future__ import annotations

from dataclasses import dataclass

import torch

OVERSAMPLE = 64
POWER_ITERS = 8
NULL_TAIL_EPS = 1e-6  # tail energy fraction treated as numerical null space and dropped
SEED = 0


@dataclass
class Truncation:
    down: torch.Tensor  # (k, in) fp32
    up: torch.Tensor  # (out, k) fp32, singular values folded in
    energy: float  # ΣS²_kept / ‖D‖²: the fraction of the delta that rides


def _svd(delta: torch.Tensor, q: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q >= min(delta.shape):  # the sketch would cover the whole space: the exact SVD is cheaper and RNG-free
        u, s, vh = torch.linalg.svd(delta, full_matrices=False)
        return u, s, vh.mT
    with torch.random.fork_rng(devices=[delta.device] if delta.device.type == "cuda" else []):
        torch.manual_seed(SEED)
        return torch.svd_lowrank(delta, q=q, niter=POWER_ITERS)


def truncate(delta: torch.Tensor, rank: int) -> Truncation:
    """Best rank-`rank` approximation of `delta` (out, in) as factors, deterministic for a given input."""
    if rank < 1:
        raise ValueError(f"host rank must be >= 1, got {rank}")
    d = delta.detach().float()
    total = float(d.pow(2).sum())
    if total == 0.0:
        return Truncation(d.new_zeros(0, d.shape[1]), d.new_zeros(d.shape[0], 0), 1.0)
    u, s, v = _svd(d, min(rank + OVERSAMPLE, min(d.shape)))
    k = min(rank, s.numel())
    energy_s = s[:k].double().pow(2)
    # Smallest prefix whose remaining tail holds less than NULL_TAIL_EPS of the delta's energy.
    tail = total - energy_s.cumsum(0)
    keep = int((tail >= NULL_TAIL_EPS * total).sum()) + 1
    k = max(1, min(k, keep))
    up = u[:, :k] * s[:k]
    down = v[:, :k].mT.contiguous()
    return Truncation(down, up.contiguous(), float(s[:k].double().pow(2).sum() / total))
