"""torch.compile-friendly runtime paths (`apply(..., compile_friendly=True, rank_buckets=...)`).

What a compiled graph guards on, and how each is kept still:
- tensor shapes: every layer's rank-concatenated pair is zero-padded to a rank bucket, so a switch between
  adapters whose ranks fall in the same bucket keeps every shape (zero rows/columns: the same product);
- Python floats: strengths and gates live in the per-rank scale tensor, rewritten in place;
- hooks: a path stays attached for the handle's life; disabling an adapter zeroes its scales
  (`Handle.disable`).
Stack modes that rebuild ΔW in Python from the strengths (ties, DARE, magnitude prune) break the graph and are
refused; select modes (klora/estlora) flip per-layer gates inside the scale tensor and compile."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ...errors import ArgumentError, ArgumentTypeError
from .path import RuntimePath

log = logging.getLogger("loraweave")

DEFAULT_BUCKETS = (8, 16, 32, 64, 128)
# Stack modes whose combined ΔW is recomputed in Python from the strengths on each change (a graph break).
GRAPH_BREAKING_STACKS = ("ties", "dare_ties", "dare_linear", "magnitude_prune")
# Per-layer cost named in the report when a term reads a Python float strength (a change recompiles).
FLOAT_STRENGTH_COST = "compile: strength read as a Python float (the first strength change recompiles once)"


@dataclass(frozen=True)
class CompileOptions:
    buckets: tuple[int, ...] = DEFAULT_BUCKETS

    def bucket(self, rank: int) -> int:
        """Smallest bucket holding `rank`; above the largest, the next multiple of the largest."""
        for b in self.buckets:
            if rank <= b:
                return b
        top = self.buckets[-1]
        return -(-rank // top) * top


def compile_options(
    compile_friendly: bool, rank_buckets: Iterable[int] | None, stack: str
) -> CompileOptions | None:
    """Validated options, or None when not asked for (rank_buckets alone is an error: it would do nothing)."""
    if not isinstance(compile_friendly, bool):
        raise ArgumentTypeError(f"compile_friendly must be a bool, got {compile_friendly!r}")
    if not compile_friendly:
        if rank_buckets is not None:
            raise ArgumentError("rank_buckets is only used with compile_friendly=True")
        return None
    buckets = DEFAULT_BUCKETS if rank_buckets is None else rank_buckets
    try:
        buckets = tuple(buckets)
    except TypeError:
        raise ArgumentError(
            f"rank_buckets must be a sequence of positive ints, got {rank_buckets!r}"
        ) from None
    if (
        not buckets
        or any(type(b) is not int or b < 1 for b in buckets)
        or list(buckets) != sorted(set(buckets))
    ):
        raise ArgumentError(f"rank_buckets must be strictly increasing positive ints, got {rank_buckets!r}")
    if stack in GRAPH_BREAKING_STACKS:
        raise ArgumentError(
            f"compile_friendly=True: stack={stack!r} rebuilds each layer's ΔW in Python whenever a strength "
            f"changes "
            "(a graph break and a recompile); use stack='sum', 'klora' or 'estlora', or mode='merge'"
        )
    return CompileOptions(buckets)


def prepare(path: RuntimePath, options: CompileOptions, floors: dict[int, int]) -> None:
    """Pad the path's rank to its bucket, never below the rank this layer was padded to before in the handle
    (`floors`, by module id: a switch down in rank keeps the shapes); name any term whose strength is a
    float."""
    if path.down is not None:
        rank = path.down.shape[0]
        path.pad_rank(max(options.bucket(rank), floors.get(id(path.module), 0)))
        floors[id(path.module)] = path.down.shape[0]
        log.debug("compile_friendly rank=%d bucket=%d", rank, path.down.shape[0])
    if path.dense or path.fns or path.base_fns or path.biases:
        path.costs.add(FLOAT_STRENGTH_COST)
