"""Which sample each row of a layer's input belongs to, found from the batch the model itself was called with.

A pre-hook on every component root records its call: the batch (rows of a tensor input, items of a list input
such as Z-Image's) and, for regions, the input's shape. A layer whose input has as many rows as that batch
maps row j to root row j; a multiple m of it (frames folded into the batch, DiT tokens packed as (B·N, C) from
equal-size samples) maps row j to root row j // m (sample-major, as diffusers folds). A root batch of k·B for
B samples holds k guidance copies in diffusers' order (`cat([uncond, cond])`): root row j is sample j % B.
Anything else is refused."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ...errors import BatchError

_INPUT_NAMES = ("hidden_states", "sample", "x", "input_ids", "inputs_embeds")


@dataclass(frozen=True)
class RootCall:
    """One call of a component root: its batch, whether every sample has one shape, its input's shape."""

    batch: int | None  # None: the input is neither a tensor nor a list of tensors
    uniform: bool
    shape: tuple[int, ...] | None  # tensor input only


def root_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> RootCall:
    x = args[0] if args else next((kwargs[k] for k in _INPUT_NAMES if k in kwargs), None)
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        return RootCall(x.shape[0], True, tuple(x.shape))
    if isinstance(x, (list, tuple)) and x and all(isinstance(t, torch.Tensor) for t in x):
        return RootCall(len(x), len({tuple(t.shape) for t in x}) == 1, None)
    return RootCall(None, False, None)


class RootProbe:
    """The call in flight of each component root (pre-hook in, forward hook out, also when forward raises)."""

    def __init__(self, roots: dict[str, torch.nn.Module]) -> None:
        self.calls: dict[str, RootCall] = {}
        self._hooks = []
        for name, root in roots.items():
            self._hooks.append(root.register_forward_pre_hook(partial(self._enter, name), with_kwargs=True))
            self._hooks.append(root.register_forward_hook(partial(self._leave, name), always_call=True))

    def _enter(
        self, name: str, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.calls[name] = root_call(args, kwargs)

    def _leave(self, name: str, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.calls.pop(name, None)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.calls.clear()


def sample_runs(call: RootCall | None, rows: int, samples: int, layer: str) -> list[tuple[int, int, int]]:
    """(start, stop, sample) for each run of consecutive input rows of one sample, in order."""
    if call is None:
        raise BatchError(
            f"{layer} ran outside its model's forward: per-sample batches map rows through the model call"
        )
    if call.batch is None:
        raise BatchError(
            f"{layer}: the model was called without a tensor or list input; its batch is unknown"
        )
    if call.batch % samples:
        raise BatchError(
            f"the model was called with a batch of {call.batch}, not a multiple of the {samples} "
            "samples of Handle.batch"
        )
    if rows == call.batch:
        per = 1
    elif rows % call.batch == 0 and call.uniform:
        per = rows // call.batch
    else:
        why = "samples of unequal size are packed" if rows % call.batch == 0 else "not a multiple of it"
        raise BatchError(
            f"{layer} sees {rows} rows for a model batch of {call.batch} ({why}): which rows belong to "
            "which sample cannot be known"
        )
    return [(j * per, (j + 1) * per, j % samples) for j in range(call.batch)]
