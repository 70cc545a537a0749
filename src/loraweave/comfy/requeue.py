"""What a runtime loader call built, kept for the re-queues ComfyUI makes
(loraweave.comfy.runtime.apply_runtime).

ComfyUI's executor caches each node's outputs by its inputs: a re-queue with another strength or file re-runs
the loader with the very same input MODEL (and CLIP) objects. A strength change then copies the kept build's
paths over the same factor tensors (their own scale vectors; one shared factor holder and ModelPatcher), and a
swap back to a file read before finds its build here: nothing is parsed, planned or built again."""

from __future__ import annotations

import atexit
import dataclasses
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..mechanisms.runtime.path import RuntimePath
from ..resolve.planner import Plan, PlannedPart

BUILDS_KEPT = 2  # a strength change needs one; two allow a swap back (each holds its combined factors)
_builds: OrderedDict[tuple[int, int, int, bool], Build] = OrderedDict()
# A kept build holds its factor ModelPatcher: drop them while ComfyUI's modules still exist (its __del__
# detaches).
atexit.register(_builds.clear)


@dataclass
class Build:
    """What one runtime loader call built from its inputs and one parsed adapter. The adapter object stands
    for the file's contents: api.read_lora returns a new one whenever the file changed, so a kept build is
    never stale. Held strongly so no other adapter can take its id; the inputs weakly."""

    model: weakref.ref
    clip: weakref.ref | None
    adapter: object
    strict: bool
    plans: list[Plan]
    states: list  # runtime.RuntimeState: [model side, CLIP side when anything landed there]

    def serves(self, model, clip, adapter, strict: bool, entries_of: Callable) -> bool:
        """Whether these inputs are the build's own, unchanged (the same earlier entries under KEY, as
        `entries_of(patcher)` reads them: runtime.py passes its own, which imports this module)."""
        held = self.clip() if self.clip is not None else None
        sides = (model, *((clip.patcher,) if len(self.states) > 1 else ()))
        return (
            self.model() is model and held is clip and self.adapter is adapter and self.strict == strict
        ) and all(
            _same(state.entries[:-1], entries_of(patcher))
            for state, patcher in zip(self.states, sides, strict=True)
        )

    def restrengthened(self, strengths: tuple[float, float]) -> tuple[list[Plan], list]:
        """(plans, states) at new strengths: copies of the kept paths over the same factor tensors, each with
        its own scale vector, so no factor is rebuilt and the kept build's clones keep their strengths."""
        plans = [_restrengthened_plan(plan, s) for plan, s in zip(self.plans, strengths, strict=False)]
        mapping = {
            id(old): new
            for was, now in zip(self.plans, plans, strict=True)
            for old, new in zip(was.planned, now.planned, strict=True)
        }
        states = [
            dataclasses.replace(
                state,
                entries=(*state.entries[:-1], dataclasses.replace(state.entries[-1], plan=plan, gate=None)),
                paths=[_restrengthened_path(rp, mapping) for rp in state.paths],
                blocked=list(state.blocked),
                factors=state.factors,  # the copies read the same factor tensors: one holder, one patcher
                injected=False,
            )
            for state, plan in zip(self.states, plans, strict=False)  # no CLIP state: nothing landed there
        ]
        return plans, states


def weak(obj) -> weakref.ref | None:
    return weakref.ref(obj) if obj is not None else None


def _same(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def kept_build(model, clip, adapter, strict: bool, entries_of: Callable) -> Build | None:
    build = _builds.get((id(model), id(clip), id(adapter), strict))
    return build if build is not None and build.serves(model, clip, adapter, strict, entries_of) else None


def keep(build: Build) -> None:
    for key in [
        k for k, b in _builds.items() if b.model() is None
    ]:  # its input is gone: so are its clones' uses
        del _builds[key]
    clip = build.clip() if build.clip is not None else None
    _builds[(id(build.model()), id(clip), id(build.adapter), build.strict)] = build
    while len(_builds) > BUILDS_KEPT:
        _builds.popitem(last=False)


def _restrengthened_plan(plan: Plan, strength: float) -> Plan:
    planned = [dataclasses.replace(pp, strength=strength * pp.block_weight) for pp in plan.planned]
    return dataclasses.replace(plan, strengths=dict.fromkeys(plan.strengths, strength), planned=planned)


def _restrengthened_path(rp: RuntimePath, mapping: dict[int, PlannedPart]) -> RuntimePath:
    """A copy of `rp` sharing its factor tensors, with its own scales, casts and hook, bound to `mapping`."""
    return rp.rebound_copy(mapping)
