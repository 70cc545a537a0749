"""Bit-pattern scans of undo records: where two weights differ, bitmask packing, scattering W's bits back.

On the CPU these run through numpy views of the same memory: its compare into a bool buffer, flatnonzero,
packbits and put are 2-4x faster than torch's CPU kernels for these ops (one thread: torch.ne into bool 1.17
ms vs 0.35 ms, nonzero 1.34 vs 0.87 ms, mask.sum 1.43 vs 0.08 ms per 1M int32 elements;
benchmarks/bench_undo.py). Elsewhere (CUDA) the torch forms run. Both produce the same positions and the same
little-endian bitmask."""

from __future__ import annotations

import numpy as np
import torch


def _np(t: torch.Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor's memory (integer bit views only), or None where torch must do the
    work."""
    if t.device.type != "cpu" or t.is_floating_point():
        return None
    return t.numpy()


def differ(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Ascending flat positions (int64) where the integer tensors a and b differ; `mask`: a bool buffer of a's
    size."""
    an, bn, mn = _np(a), _np(b), _np(mask)
    if an is None or bn is None or mn is None:
        return torch.ne(a, b, out=mask).nonzero().squeeze(1)
    np.not_equal(an, bn, out=mn)
    return torch.from_numpy(np.flatnonzero(mn))


def pack_positions(positions: torch.Tensor, numel: int) -> torch.Tensor:
    """A bitmask (uint8, bit i of byte j = element 8j+i) with the given flat positions set."""
    pn = _np(positions)
    if pn is not None:
        flags = np.zeros(numel, dtype=np.bool_)
        flags[pn] = True
        return torch.from_numpy(np.packbits(flags, bitorder="little"))
    mask = torch.zeros(numel, dtype=torch.bool, device=positions.device)
    mask[positions] = True
    pad = (-numel) % 8
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    return (m << torch.arange(8, dtype=torch.uint8, device=m.device)).sum(1, dtype=torch.uint8)


def unpack_positions(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ascending flat positions (int64) set in a bitmask from pack_positions."""
    pn = _np(packed)
    if pn is not None:
        return torch.from_numpy(np.flatnonzero(np.unpackbits(pn, count=numel, bitorder="little")))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(1) >> shifts) & 1).view(-1)[:numel].nonzero().squeeze(1)


def put(flat: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """flat[positions] = values (an integer bit view, written in place)."""
    fn, pn, vn = _np(flat), _np(positions), _np(values)
    if fn is None or pn is None or vn is None:
        flat[positions] = values
        return
    np.put(fn, pn, vn)


def insert_zeros(values: torch.Tensor, at: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`values` (int64) with counts[i] zeros inserted before values[at[i]] (`at` ascending, unique)."""
    vn, an, cn = _np(values), _np(at), _np(counts)
    if vn is not None and an is not None and cn is not None:
        return torch.from_numpy(np.insert(vn, np.repeat(an, cn), 0))
    shift = torch.zeros_like(values)
    shift[at] = counts
    out = values.new_zeros(values.numel() + int(counts.sum()))
    out[torch.arange(values.numel(), device=values.device) + shift.cumsum(0)] = values
    return out


def take(flat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """flat[positions] (an integer bit view), through numpy on the CPU (2.5x torch's gather there)."""
    fn, pn = _np(flat), _np(positions)
    if fn is None or pn is None:
        return flat[positions]
    return torch.from_numpy(np.take(fn, pn))
