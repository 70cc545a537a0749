"""What `apply` returns: undo (`remove`), strength changes, switching to another set, select-mode layer
choices.

Everything the handle changed in the model is in its journal (journal.py); remove, set_strength and switch
read it and write it, under the model's lock."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from ..errors import StateError, UnknownNameError
from ..mechanisms.merge import layer as merge_mechanism
from ..mechanisms.merge.layer import MergedModule
from ..mechanisms.merge.params import ParamPatch
from ..mechanisms.merge.undo import reused_buffers
from ..mechanisms.quantized import write as quant_mechanism
from ..mechanisms.quantized.write import QuantWrite
from ..mechanisms.runtime.path import RuntimePath
from ..mechanisms.sampling.mix import Mix
from ..modes import StackMode
from ..report.report import AppliedModule, Report
from ..request.spec import finite_strength
from ..resolve.params import PlannedParam
from ..resolve.planner import Plan, PlannedPart
from ..resolve.target import Components
from ..resolve.weights import AdapterWeights, part_strength
from .install import AdapterSet
from .journal import Installed, Journal, model_lock
from .options import Options
from .state import HandleState, batch, clear_region, set_region

if TYPE_CHECKING:
    from ..mechanisms.sampling.steps import StepSchedule
    from ..stack.select import SelectSchedule


class Handle:
    """What `apply` did; `remove()` undoes it exactly. Usable as a context manager.

    Its state (engine/state.py) is one object it owns and hands to what edits it (switch, batch, regions)."""

    def __init__(
        self,
        plan: Plan,
        report: Report,
        journal: Journal,
        settings: dict[str, AdapterWeights] | None = None,
        options: Options | None = None,
    ) -> None:
        if options is None:
            if report.mode == "plan":  # plan() returns a report, never a handle
                raise StateError("a plan report has no handle")
            options = Options(mode=report.mode)
        self._state = HandleState(
            plan,
            report,
            journal,
            settings or {name: AdapterWeights(s) for name, s in plan.strengths.items()},
            options,
        )

    @property
    def report(self) -> Report:
        return self._state.report

    @property
    def journal(self) -> Journal:
        return self._state.journal

    @property
    def options(self) -> Options:
        return self._state.options

    @property
    def active(self) -> bool:
        return self._state.active

    @property
    def last_switch(self) -> dict[str, int] | None:
        """Layers the last `switch` kept / reattached / rebuilt / dropped."""
        return self._state.last_switch

    # Views of the journal by kind of change (read-only lists).
    @property
    def merged_layers(self) -> list[MergedModule]:
        return self._state.merged()

    @property
    def runtime_paths(self) -> list[RuntimePath]:
        return self._state.runtime()

    @property
    def quant_writes(self) -> list[QuantWrite]:
        return self._state.quant()

    @property
    def mix(self) -> Mix | None:
        """The per-sample batch / regional state while one is open (its root hooks live on the model), else
        None."""
        return self._state.mix

    @property
    def components(self) -> Components | None:
        """The target's components (name -> module); None once removed."""
        return self._state.plan.components if self._state.plan is not None else None

    @property
    def quant_options(self) -> dict[str, object]:
        return {
            "quantized": self.options.quantized,
            "host_rank": self.options.host_rank,
            "cache": self.options.cache,
        }

    def lock(self) -> AbstractContextManager[None]:
        """The model's lock: held by every change this handle makes (other threads wait); a removed handle no
        longer knows the model (it holds only its report), so it has none."""
        if self._state.plan is None:
            return nullcontext()
        return model_lock(self._state.plan.components.modules.values())

    def check_undoable(self, names: set[str] | None = None) -> None:
        """Refuse when a later apply merged over this handle's layers (of adapters `names`, default any)."""
        self._state.check_undoable(names)

    def remove(self) -> None:
        """Restore merged weights bit-exactly and detach runtime paths. Idempotent."""
        state = self._state
        with self.lock():
            if not state.active:
                return
            self.check_undoable()
            for merged in state.merged():  # a source file that changed is refused before anything is touched
                merged.check_undo()
            with reused_buffers():  # the undo scratch of every merged layer shared
                state.journal.undo()
            state.drop_mix()  # per-sample / regional state: its root hooks go too
            state.detached.clear()
            state.active = False
        state.release()

    def set_strength(self, name: str, value: float, te: float | None = None) -> None:
        """Change one adapter's strength (and, with `te`, its text-encoder strength; else text encoders keep
        theirs when it was set apart, or follow). Runtime: a scale update only. Merge: rewritten from the
        backup. Block weights stay."""
        state = self._state
        with self.lock():
            if not state.active:
                raise StateError("handle was removed")
            strengths = state.live_plan().strengths
            if name not in strengths:
                raise UnknownNameError(f"no adapter named {name!r}; have {sorted(strengths)}")
            value = finite_strength(
                value
            )  # no float() first: "0.5" and True are refused, as AdapterSpec does
            te = None if te is None else finite_strength(te, "te")
            self.check_undoable({name})
            for merged in state.merged():  # fused (undo='none') or a changed source file: refused first
                if name in merged.adapters:
                    merged.check_undo(rewrite=True)
            before = (state.settings[name].strength, state.settings[name].te_strength)
            try:
                self._set_weights(name, value, te if te is not None else before[1])
            except BaseException:  # e.g. a merge that would overflow: every layer back at the old strengths
                self._set_weights(name, *before)
                raise
            state.disabled.pop(name, None)  # an explicit strength ends a `disable`
            for summary in state.report.adapters:
                if summary["name"] == name:
                    summary["strength"] = float(value)

    def disable(self, name: str | None = None) -> None:
        """Switch an adapter (None: all) off without removing anything: its strength goes to 0 (runtime: a
        scale write, so a compiled model does not recompile) and `enable` brings the previous strengths
        back."""
        for n in self._names(name):
            if n not in self._state.disabled:
                w = self._state.settings[n]
                saved = (w.strength, w.te_strength)
                self.set_strength(n, 0.0, te=None if w.te_strength is None else 0.0)
                self._state.disabled[n] = saved  # after: set_strength forgets a disabled state

    def enable(self, name: str | None = None) -> None:
        """Undo `disable` (None: every disabled adapter)."""
        for n in self._names(name):
            if n in self._state.disabled:
                strength, te = self._state.disabled.pop(n)
                self.set_strength(n, strength, te=te)

    def _names(self, name: str | None) -> list[str]:
        if not self._state.active:
            raise StateError("handle was removed")
        strengths = self._state.live_plan().strengths
        if name is not None and name not in strengths:
            raise UnknownNameError(f"no adapter named {name!r}; have {sorted(strengths)}")
        return list(strengths) if name is None else [name]

    def _set_weights(self, name: str, strength: float, te: float | None) -> None:
        plan, weights = self._state.live_plan(), self._state.settings[name]
        plan.strengths[name] = strength
        weights.strength, weights.te_strength = strength, te
        parts: list[PlannedPart | PlannedParam] = [*plan.planned, *plan.params]
        for pp in parts:
            if pp.adapter.name == name:
                pp.strength = part_strength(pp, weights)
        with reused_buffers():  # merged layers rewritten one after another share their scratch buffers
            for entry in self.journal.entries:
                if name in entry.adapters:
                    _rewrite(entry)

    @property
    def planned(self) -> list[PlannedPart]:
        """Every planned part (adapter part, component, pieces, strength): read it, change it via the
        setters."""
        return self._state.live_plan().planned

    def runtime_layers(self) -> dict[tuple[str, str], RuntimePath]:
        """{(component, module path): runtime path}; `RuntimePath.set_gate` scales one adapter on one
        layer."""
        return self._state.runtime_layers()

    def set_part_strengths(self, strength_of: Callable[[PlannedPart], float]) -> None:
        """Set each planned part's strength to `strength_of(part)` (a caller's own per-module rule, e.g. the
        diffusers drop-in) and rewrite what reads it: runtime scales, merged layers from their backups."""
        with self.lock():
            if not self.active:
                raise StateError("handle was removed")
            self.check_undoable()
            for pp in self._state.live_plan().planned:
                pp.strength = finite_strength(float(strength_of(pp)))
            with reused_buffers():
                for entry in self.journal.entries:
                    _rewrite(entry)

    def keep(self) -> None:
        """Make the merges permanent (diffusers' unload after a fuse): backups are freed, runtime paths
        detached, and the handle can no longer undo. Only the newest merge on each layer can be kept, and
        earlier merges on those layers should be kept too: their undo restores backups taken before this
        delta."""
        with self.lock():
            if not self.active:
                return
            self.check_undoable()
            for entry in self.journal.entries:
                if isinstance(entry, RuntimePath):
                    entry.undo()
                for cls, attr in (
                    (MergedModule, merge_mechanism.STACK_ATTR),
                    (QuantWrite, quant_mechanism.STACK_ATTR),
                ):
                    if isinstance(entry, cls):
                        getattr(entry.module, attr).remove(entry)
            self.journal.forget(list(self.journal.entries))
            self._state.active = False

    def select_schedule(self, total_steps: int, **kwargs: float) -> SelectSchedule:
        """For stack="klora"/"estlora": the per-layer subject->style schedule over `total_steps` sampling
        steps.

        Use: `s = handle.select_schedule(steps); s.prime(handle)`, then pass
        `callback_on_step_end=s.diffusers_callback(handle)` to the diffusers pipeline call."""
        selection = self._state.select
        if selection is None:
            raise StateError("select_schedule needs apply(..., stack='klora' or 'estlora')")
        from ..mechanisms.sampling.select import build_schedule

        paths = self._state.runtime_by_key()
        return build_schedule(selection.mode, paths, selection.names, total_steps, **kwargs)

    def set_layer_choice(self, layer_key: str, index: int) -> None:
        """Select modes: run the subject (0) or the style (1) adapter on one layer from now on."""
        from ..mechanisms.sampling.select import choose

        selection = self._state.select
        if selection is None:
            raise StateError("set_layer_choice needs apply(..., stack='klora' or 'estlora')")
        paths = self._state.runtime_by_key()
        if layer_key not in paths:
            raise UnknownNameError(f"no runtime layer {layer_key!r}")
        choose(paths[layer_key], selection.names, index)

    def start_selection(self) -> None:
        """Select modes: remember the pair and start every shared layer on the subject (step 0 of any
        schedule); other modes: no selection."""
        self._state.start_selection()

    def switch(
        self,
        adapters: AdapterSet,
        strength: float = 1.0,
        stack: StackMode = "sum",
        density: float | None = None,
        allow_other_arch: bool = False,
    ) -> None:
        """Replace the applied set with a new one, touching only layers whose contributions changed.

        Checked like apply (same options rules, before anything changes): a file of another architecture
        than the model's is refused (WrongArchitectureError, the handle keeps its set) unless
        `allow_other_arch`, and the report's `other_arch` says what was let through. Same structure on a
        layer: re-pointed (runtime: scale update; merge: rewritten only if a strength changed). Runtime
        layers that only lose adapters whose terms vanish at strength 0 gate them to 0 (no allocation);
        others are rebuilt. `last_switch` counts kept / reattached / rebuilt / dropped layers. If it fails
        midway, every adapter is removed and the error raised."""
        from .switch import switch

        state = self._state
        try:
            with self.lock():
                switch(state, adapters, strength, stack, density, allow_other_arch)
        finally:
            if state.mix is not None:  # open batch / regions follow the new paths (or go with them)
                state.attach_mix() if state.active else state.release_mix()

    def batch(
        self, assignments: list[list[str]], strengths: list[object] | None = None, exact: bool = False
    ) -> AbstractContextManager[None]:
        """Context manager: inside it, sample i of each forward uses only the adapters `assignments[i]`
        (runtime).

        `strengths[i]` (optional) is a list aligned with `assignments[i]` or a {name: strength} mapping;
        default: the adapters' current strengths. A model batch of k·B rows for B samples is read as k
        guidance copies (`cat([uncond, cond])`); rows are mapped to samples through the model's own input (see
        mechanisms/sampling/rows.py) and a layer whose rows cannot be mapped raises BatchError. A sample's
        terms are summed in its list's order.

        exact: each set's terms are computed over every row, as a lone runtime `apply` of its list computes
        them, and kept on its samples' rows (a low-rank pass per set, and an output-sized buffer, on layers
        where several sets meet): a sample's output is then bit-equal to that lone apply's at the same batch
        shape, whatever the other samples use (low-rank pairs; CPU BLAS and oneDNN round by row count, so the
        per-run GEMMs and the gated whole-pair form short runs use by default differ from it by float
        rounding)."""
        return batch(self._state, assignments, strengths, exact)

    def set_region(self, name: str, mask: object) -> None:
        """Confine a runtime adapter to an image-space mask (H×W, 0..1), per image token
        (mechanisms/sampling/region.py)."""
        set_region(self._state, name, mask)

    def clear_region(self, name: str) -> None:
        """Apply the adapter everywhere again."""
        clear_region(self._state, name)

    def step_schedule(self, total_steps: int) -> StepSchedule:
        """Strengths per sampling step from the adapters' `steps=` windows and ramps
        (mechanisms/sampling/steps.py).

        Sets step 0 at once; pass the result as `callback_on_step_end=` to a diffusers pipeline call."""
        from ..mechanisms.sampling.steps import StepSchedule, check_total_steps

        state = self._state
        check_total_steps(total_steps)
        if not state.active:
            raise StateError("handle was removed")
        planned = state.live_plan().planned
        return StepSchedule(total_steps, state.settings, planned, state.runtime(), state.written())

    @property
    def strengths(self) -> dict[str, float]:
        plan = self._state.plan
        return dict(plan.strengths) if plan is not None else dict(self._state.removed_strengths)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Handle(active={self.active}, {self.report.summary()})"


def _rewrite(entry: Installed) -> None:
    """Bring one journal entry to the current strengths."""
    if isinstance(entry, RuntimePath):
        entry.refresh_scales()
    elif isinstance(entry, MergedModule):
        entry.write()
    elif isinstance(entry, ParamPatch):
        entry.rewrite()
    elif isinstance(entry, QuantWrite):  # rewritten from the layer's original tensors: nothing compounds
        entry.write()
        if isinstance(entry.entry, AppliedModule):  # the report row install gave it
            entry.entry.retention, entry.entry.capture, entry.entry.rank = (
                entry.retention,
                entry.capture,
                entry.rank,
            )
