"""The rank-concatenated low-rank pair of one runtime path, built from its terms with as few copies as the
memory allows: none where the factors are the adapter's own and already in place, otherwise one per factor."""

from __future__ import annotations

import functools

import torch

from ...families.base import RuntimeTerm


def concatenated(
    pairs: list[tuple[torch.Tensor, list[RuntimeTerm]]], out: int, borrow: bool
) -> tuple[torch.Tensor, ...]:
    """The rank-concatenated (down (R, in, *k), up (out, R)) of every pair, each factor copied once into place
    (the dtypes torch.cat would promote to); rows of `up` no chunk writes are zero. A copy, not a view: the
    factors outlive the file they were read from (a LoRA saved again over a mapped file). `borrow`: their
    memory is the adapter's own (read whole, never written): one pair whose row chunks already sit at their
    own rows of one tensor (the whole layer, or a fused layer's row ranges) is kept as it is, as views."""
    (down, chunks), *more = pairs
    up = _rows_in_place(chunks, out) if borrow and not more and down.is_contiguous() else None
    if up is not None:
        return down, up
    downs = [d for d, _ in pairs]
    ups = [_up(t) for _, chunks in pairs for t in chunks]
    down = torch.empty(
        (sum(d.shape[0] for d in downs), *downs[0].shape[1:]),
        dtype=functools.reduce(torch.promote_types, (d.dtype for d in downs)),
        device=downs[0].device,
    )
    whole = all(len(c) == 1 and c[0].dst_start == 0 and c[0].length == out for _, c in pairs)
    up = (torch.empty if whole else torch.zeros)(
        (out, down.shape[0]),
        dtype=functools.reduce(torch.promote_types, (u.dtype for u in ups)),
        device=ups[0].device,
    )
    col = 0
    for d, chunks in pairs:
        rank = d.shape[0]
        down[col : col + rank].copy_(d)
        for t in chunks:
            up[t.dst_start : t.dst_start + t.length, col : col + rank].copy_(_up(t))
        col += rank
    return down, up


def _up(term: RuntimeTerm) -> torch.Tensor:
    assert term.up is not None  # a pair's row chunk carries its up rows (RuntimePath gathers only those)
    return term.up


def _rows_in_place(chunks: list[RuntimeTerm], out: int) -> torch.Tensor | None:
    """The (out, r) up that `chunks` tile when each is already at its own rows of one contiguous tensor (a
    part split over a fused layer's row ranges: Flux's qkv, linear1), as a view of it; None otherwise."""
    first = _up(chunks[0])
    row = first.stride(0) * first.element_size()
    base = first.data_ptr() - chunks[0].dst_start * row
    rows = 0
    for t in sorted(chunks, key=lambda t: t.dst_start):
        up = _up(t)
        if (
            t.dst_start != rows
            or not up.is_contiguous()
            or up.dtype != first.dtype
            or up.shape[1:] != first.shape[1:]
        ):
            return None
        if (
            up.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or up.data_ptr() != base + rows * row
        ):
            return None
        rows += t.length
    if rows != out:
        return None
    offset = first.storage_offset() - chunks[0].dst_start * first.stride(0)
    return first.as_strided((out, *first.shape[1:]), first.stride(), offset)
