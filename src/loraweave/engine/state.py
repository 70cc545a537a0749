"""Everything a Handle knows between calls, in one typed object the handle owns and hands to what edits it
(switch.py, the sampling mechanisms' bookkeeping below, step schedules). Mechanisms never see this object:
they get the narrow pieces they need (settings, planned parts, journal views)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard

from ..errors import BatchError, RegionError, StateError
from ..mechanisms.merge.grow import GrownInput
from ..mechanisms.merge.layer import MergedModule
from ..mechanisms.quantized.write import QuantWrite
from ..mechanisms.runtime.path import RuntimePath
from ..mechanisms.sampling import mix as mixing
from ..mechanisms.sampling.mix import Mix
from ..mechanisms.sampling.region import check_mask
from ..modes import SELECT_MODES, SelectStackMode, StackMode
from ..report.report import Report
from ..resolve.planner import Plan
from ..resolve.weights import AdapterWeights
from .journal import Journal
from .options import Options

if TYPE_CHECKING:
    from ..resolve.cache import ResolveCache


def is_select_mode(stack: StackMode) -> TypeGuard[SelectStackMode]:
    return stack in SELECT_MODES


@dataclass
class Selection:
    """Select modes (klora / estlora): the mode and the (subject, style) adapter pair."""

    mode: SelectStackMode
    names: tuple[str, str]


@dataclass
class HandleState:
    """The applied set (plan, per-adapter settings, options), what changed the model (journal), and what the
    handle's calls keep between them. A removed handle keeps its report and its last strengths only."""

    plan: Plan | None
    report: Report
    journal: Journal
    settings: dict[str, AdapterWeights]
    options: Options
    active: bool = True
    last_switch: dict[str, int] | None = None  # kept / reattached / rebuilt / dropped layers
    resolve_cache: ResolveCache | None = None  # switching: loads and resolutions per source
    detached: dict[tuple[int, tuple[object, ...]], RuntimePath] = field(
        default_factory=dict
    )  # switching: paths the last switch took off, by (module id, structure)
    disabled: dict[str, tuple[float, float | None]] = field(
        default_factory=dict
    )  # name -> (strength, te strength) that `enable` restores
    select: Selection | None = None
    mix: Mix | None = None  # per-sample batch / regions, while one is open
    removed_strengths: dict[str, float] = field(default_factory=dict)

    # Views of the journal by kind of change (read-only lists).
    def merged(self) -> list[MergedModule]:
        return self.journal.of(MergedModule)

    def runtime(self) -> list[RuntimePath]:
        return self.journal.of(RuntimePath)

    def quant(self) -> list[QuantWrite]:
        return self.journal.of(QuantWrite)

    def grown(self) -> list[GrownInput]:
        return self.journal.of(GrownInput)

    def written(self) -> list[MergedModule | QuantWrite]:
        """Layers whose weights (or quantized storage) hold adapter terms: nothing there varies per row or
        step."""
        return [*self.merged(), *self.quant()]

    def check_undoable(self, names: set[str] | None = None) -> None:
        """Refuse when a later apply merged over these layers (of adapters `names`, default any)."""
        buried = [e for e in self.journal.buried() if names is None or names & e.adapters]
        if buried:
            raise StateError(
                f"{len(buried)} merged layers were merged again by a later apply; remove that handle first "
                "(merges undo exactly only in reverse order)"
            )

    def live_plan(self) -> Plan:
        """The applied plan; a removed handle has none."""
        if self.plan is None:
            raise StateError("handle was removed")
        return self.plan

    def runtime_layers(self) -> dict[tuple[str, str], RuntimePath]:
        roots = self.live_plan().components
        modules = {id(m): (c, n) for c, root in roots for n, m in root.named_modules()}
        return {modules[id(rp.module)]: rp for rp in self.runtime()}

    def runtime_by_key(self) -> dict[str, RuntimePath]:
        return {f"{c}.{n}": rp for (c, n), rp in self.runtime_layers().items()}

    def start_selection(self) -> None:
        """Select modes: remember the pair and start every shared layer on the subject (step 0 of any
        schedule); other modes: no selection."""
        stack = self.options.stack
        if not is_select_mode(stack):
            self.select = None
            return
        from ..mechanisms.sampling.select import choose, shared_layers

        adapters = self.live_plan().adapters
        names = (adapters[0].name, adapters[1].name)
        self.select = Selection(stack, names)
        for rp in shared_layers(self.runtime_by_key(), names).values():
            choose(rp, names, 0)

    def adopt(
        self, plan: Plan, settings: dict[str, AdapterWeights], options: Options, report: Report
    ) -> None:
        """A switch landed: the new set is the applied one (it comes with its own strengths: nothing
        disabled)."""
        self.plan, self.settings, self.options, self.report = plan, settings, options, report
        self.disabled = {}

    def release(self) -> None:
        """Drop the plan (factors, model), settings, caches and options: a removed handle holds only its
        report."""
        if self.plan is not None:
            self.removed_strengths = dict(self.plan.strengths)
        self.plan, self.settings, self.resolve_cache, self.select = None, {}, None, None
        self.detached = {}
        self.options = Options(mode=self.options.mode)

    def attach_mix(self) -> Mix:
        """The Mix, created on first use and (re)attached to every runtime path."""
        names = {id(rp): key for key, rp in self.runtime_by_key().items()}
        roots = dict(self.live_plan().components)
        self.mix = mixing.mix_for(self.mix, roots, names, self.runtime(), self.settings)
        return self.mix

    def release_mix(self) -> None:
        """Detach the Mix once it has neither a batch nor a region (or the handle is gone); a switch may
        re-attach the detached paths, so they let go of it too."""
        paths = [*self.runtime(), *self.detached.values()]
        self.mix = mixing.release(self.mix, paths, self.active)

    def drop_mix(self) -> None:
        """Removal: the Mix's root hooks go with the adapters."""
        if self.mix is not None:
            self.mix.remove()
            self.mix = None


@contextmanager
def batch(
    state: HandleState,
    assignments: Sequence[Sequence[str]],
    strengths: Sequence[object] | None = None,
    exact: bool = False,
) -> Iterator[None]:
    """Handle.batch: per-sample adapter sets for the forwards run inside the block."""
    mixing.check_batch(state.active, exact, state.mix)
    known = {name: w.strength for name, w in state.settings.items()}
    mix = state.attach_mix()
    try:
        mix.set_batch(assignments, strengths, known, exact)
        names = {n for key in mix.keys or () for n, _ in key}  # set_batch has set the keys
        mixing.require_runtime(state.written(), names, BatchError, "batch")
        yield
    finally:
        mix.clear_batch()
        state.release_mix()


def set_region(state: HandleState, name: str, mask: object) -> None:
    if not state.active:
        raise RegionError("handle was removed")
    if name not in state.settings:
        raise RegionError(f"no adapter named {name!r}; have {sorted(state.settings)}")
    mixing.require_runtime(state.written(), {name}, RegionError, "region")
    checked = check_mask(name, mask)  # before the mix attaches: a refused mask leaves no root hooks
    state.attach_mix().set_region(name, checked)


def clear_region(state: HandleState, name: str) -> None:
    if state.mix is not None:
        state.mix.clear_region(name)
        state.release_mix()
