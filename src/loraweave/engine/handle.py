"""What `apply` returns: undo (`remove`), strength changes, switching to another set, select-mode layer choices.

Everything the handle changed in the model is in its journal (journal.py); remove, set_strength and switch read
it and write it, under the model's lock."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

from ..mechanisms.merge import layer as merge_mechanism
from ..mechanisms.merge.grow import GrownInput
from ..mechanisms.merge.layer import MergedModule
from ..mechanisms.merge.params import ParamPatch
from ..mechanisms.merge.undo import reused_buffers
from ..mechanisms.quantized import write as quant_mechanism
from ..mechanisms.quantized.write import QuantWrite
from ..mechanisms.runtime.path import RuntimePath
from ..report.report import Report
from ..request.spec import finite_strength
from ..resolve.planner import Plan, PlannedPart
from ..resolve.weights import AdapterWeights, part_strength
from .install import Options
from .journal import Journal, model_lock


class Handle:
    """What `apply` did; `remove()` undoes it exactly. Usable as a context manager."""

    def __init__(
        self,
        plan: Plan,
        report: Report,
        journal: Journal,
        settings: dict[str, AdapterWeights] | None = None,
        options: Options | None = None,
    ) -> None:
        self._plan = plan
        self.report = report
        self.journal = journal
        self._settings = settings or {name: AdapterWeights(s) for name, s in plan.strengths.items()}
        self.options = options or Options(mode=report.mode)
        self._select: tuple[str, tuple[str, str]] | None = None  # (mode, (subject, style)) for select modes
        self._resolve_cache = None  # switching: loads and resolutions per source (plan.cache.ResolveCache)
        self._detached: dict = {}  # switching: paths the last switch took off, by (module id, structure)
        self.last_switch: dict[str, int] | None = None  # kept / reattached / rebuilt / dropped layers
        self._disabled: dict[
            str, tuple[float, float | None]
        ] = {}  # name -> (strength, te strength) to restore
        self.active = True

    # Views of the journal by kind of change (read-only lists).
    @property
    def _merged(self) -> list[MergedModule]:
        return self.journal.of(MergedModule)

    @property
    def _runtime(self) -> list[RuntimePath]:
        return self.journal.of(RuntimePath)

    @property
    def _quant(self) -> list[QuantWrite]:
        return self.journal.of(QuantWrite)

    @property
    def _grown(self) -> list[GrownInput]:
        return self.journal.of(GrownInput)

    @property
    def quant_options(self) -> dict:
        return {
            "quantized": self.options.quantized,
            "host_rank": self.options.host_rank,
            "cache": self.options.cache,
        }

    def lock(self):
        """The model's lock: held by every change this handle makes (other threads wait); a removed handle no
        longer knows the model (it holds only its report), so it has none."""
        if self._plan is None:
            return nullcontext()
        return model_lock(self._plan.components.modules.values())

    def check_undoable(self, names: set[str] | None = None) -> None:
        """Refuse when a later apply merged over this handle's layers (of adapters `names`, default any)."""
        buried = [e for e in self.journal.buried() if names is None or names & e.adapters]
        if buried:
            raise RuntimeError(
                f"{len(buried)} merged layers were merged again by a later apply; remove that handle first "
                "(merges undo exactly only in reverse order)"
            )

    def remove(self) -> None:
        """Restore merged weights bit-exactly and detach runtime paths. Idempotent."""
        with self.lock():
            if not self.active:
                return
            self.check_undoable()
            for merged in self._merged:  # a source file that changed is refused before anything is touched
                merged.check_undo()
            self.journal.undo()
            if getattr(self, "_mix", None) is not None:  # per-sample / regional state: its root hooks go too
                self._mix.remove()
                self._mix = None
            self._detached.clear()
            self.active = False
        self._release()

    def _release(self) -> None:
        """Drop the plan (factors, model), settings, caches and options: a removed handle holds only its report."""
        if self._plan is not None:
            self._removed_strengths = dict(self._plan.strengths)
        self._plan, self._settings, self._resolve_cache, self._select = None, {}, None, None
        self._detached = {}
        self.options = Options(mode=self.options.mode)

    def set_strength(self, name: str, value: float, te: float | None = None) -> None:
        """Change one adapter's strength (and, with `te`, its text-encoder strength; else text encoders keep
        theirs when it was set apart, or follow). Runtime: a scale update only. Merge: rewritten from the backup.
        Block weights stay."""
        with self.lock():
            if not self.active:
                raise RuntimeError("handle was removed")
            if name not in self._plan.strengths:
                raise KeyError(f"no adapter named {name!r}; have {sorted(self._plan.strengths)}")
            value = finite_strength(
                value
            )  # no float() first: "0.5" and True are refused, as AdapterSpec does
            te = None if te is None else finite_strength(te)
            self.check_undoable({name})
            for merged in self._merged:  # fused (undo='none') or a changed source file: refused first
                if name in merged.adapters:
                    merged.check_undo(rewrite=True)
            before = (self._settings[name].strength, self._settings[name].te_strength)
            try:
                self._set_weights(name, value, te if te is not None else before[1])
            except BaseException:  # e.g. a merge that would overflow: every layer back at the old strengths
                self._set_weights(name, *before)
                raise
            self._disabled.pop(name, None)  # an explicit strength ends a `disable`
            for summary in self.report.adapters:
                if summary["name"] == name:
                    summary["strength"] = float(value)

    def disable(self, name: str | None = None) -> None:
        """Switch an adapter (None: all) off without removing anything: its strength goes to 0 (runtime: a scale
        write, so a compiled model does not recompile) and `enable` brings the previous strengths back."""
        for n in self._names(name):
            if n not in self._disabled:
                w = self._settings[n]
                saved = (w.strength, w.te_strength)
                self.set_strength(n, 0.0, te=None if w.te_strength is None else 0.0)
                self._disabled[n] = saved  # after: set_strength forgets a disabled state

    def enable(self, name: str | None = None) -> None:
        """Undo `disable` (None: every disabled adapter)."""
        for n in self._names(name):
            if n in self._disabled:
                strength, te = self._disabled.pop(n)
                self.set_strength(n, strength, te=te)

    def _names(self, name: str | None) -> list[str]:
        if not self.active:
            raise RuntimeError("handle was removed")
        if name is not None and name not in self._plan.strengths:
            raise KeyError(f"no adapter named {name!r}; have {sorted(self._plan.strengths)}")
        return list(self._plan.strengths) if name is None else [name]

    def _set_weights(self, name: str, strength: float, te: float | None) -> None:
        self._plan.strengths[name] = strength
        self._settings[name].strength, self._settings[name].te_strength = strength, te
        for pp in (*self._plan.planned, *self._plan.params):
            if pp.adapter.name == name:
                pp.strength = part_strength(pp, self._settings[name])
        with reused_buffers():  # merged layers rewritten one after another share their scratch buffers
            for entry in self.journal.entries:
                if name in entry.adapters:
                    _rewrite(entry)

    @property
    def planned(self) -> list[PlannedPart]:
        """Every planned part (adapter part, component, pieces, strength): read it, change it via the setters."""
        return self._plan.planned

    def runtime_layers(self) -> dict[tuple[str, str], RuntimePath]:
        """{(component, module path): runtime path}; `RuntimePath.set_gate` scales one adapter on one layer."""
        modules = {id(m): (c, n) for c, root in self._plan.components for n, m in root.named_modules()}
        return {modules[id(rp.module)]: rp for rp in self._runtime}

    def set_part_strengths(self, strength_of: Callable[[PlannedPart], float]) -> None:
        """Set each planned part's strength to `strength_of(part)` (a caller's own per-module rule, e.g. the
        diffusers drop-in) and rewrite what reads it: runtime scales, merged layers from their backups."""
        with self.lock():
            if not self.active:
                raise RuntimeError("handle was removed")
            self.check_undoable()
            for pp in self._plan.planned:
                pp.strength = finite_strength(float(strength_of(pp)))
            with reused_buffers():
                for entry in self.journal.entries:
                    _rewrite(entry)

    def keep(self) -> None:
        """Make the merges permanent (diffusers' unload after a fuse): backups are freed, runtime paths detached,
        and the handle can no longer undo. Only the newest merge on each layer can be kept, and earlier merges
        on those layers should be kept too: their undo restores backups taken before this delta."""
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
            self.active = False

    def select_schedule(self, total_steps: int, **kwargs: float):
        """For stack="klora"/"estlora": the per-layer subject->style schedule over `total_steps` sampling steps.

        Use: `s = handle.select_schedule(steps); s.prime(handle)`, then pass
        `callback_on_step_end=s.diffusers_callback(handle)` to the diffusers pipeline call."""
        if self._select is None:
            raise RuntimeError("select_schedule needs apply(..., stack='klora' or 'estlora')")
        from ..mechanisms.sampling.select import build_schedule

        return build_schedule(self._select[0], self._runtime_by_key(), self._select[1], total_steps, **kwargs)

    def set_layer_choice(self, layer_key: str, index: int) -> None:
        """Select modes: run the subject (0) or the style (1) adapter on one layer from now on."""
        from ..mechanisms.sampling.select import choose

        if self._select is None:
            raise RuntimeError("set_layer_choice needs apply(..., stack='klora' or 'estlora')")
        paths = self._runtime_by_key()
        if layer_key not in paths:
            raise KeyError(f"no runtime layer {layer_key!r}")
        choose(paths[layer_key], self._select[1], index)

    def _runtime_by_key(self) -> dict[str, RuntimePath]:
        return {f"{c}.{n}": rp for (c, n), rp in self.runtime_layers().items()}

    def start_selection(self) -> None:
        """Select modes: remember the pair and start every shared layer on the subject (step 0 of any schedule);
        other modes: no selection."""
        if not self.options.select:
            self._select = None
            return
        from ..mechanisms.sampling.select import choose, shared_layers

        self._select = (self.options.stack, (self._plan.adapters[0].name, self._plan.adapters[1].name))
        for rp in shared_layers(self._runtime_by_key(), self._select[1]).values():
            choose(rp, self._select[1], 0)

    def switch(
        self, adapters, strength: float = 1.0, stack: str = "sum", density: float | None = None
    ) -> None:
        """Replace the applied set with a new one, touching only layers whose contributions changed.

        Checked like apply (same options rules, before anything changes). Same structure on a layer: re-pointed
        (runtime: scale update; merge: rewritten only if a strength changed). Runtime layers that only lose
        adapters whose terms vanish at strength 0 gate them to 0 (no allocation); others are rebuilt.
        `last_switch` counts kept / reattached / rebuilt / dropped layers. If it fails midway, every adapter is
        removed and the error raised."""
        from .switch import switch

        try:
            with self.lock():
                switch(self, adapters, strength, stack, density)
        finally:
            if (
                getattr(self, "_mix", None) is not None
            ):  # open batch / regions follow the new paths (or go with them)
                from ..mechanisms.sampling.mix import mix_for, release

                mix_for(self) if self.active else release(self)

    def batch(self, assignments: list[list[str]], strengths: list | None = None, exact: bool = False):
        """Context manager: inside it, sample i of each forward uses only the adapters `assignments[i]` (runtime).

        `strengths[i]` (optional) is a list aligned with `assignments[i]` or a {name: strength} mapping; default: the
        adapters' current strengths. A model batch of k·B rows for B samples is read as k guidance copies
        (`cat([uncond, cond])`); rows are mapped to samples through the model's own input (see mechanisms/rows.py)
        and a layer whose rows cannot be mapped raises BatchError. A sample's terms are summed in its list's order.

        exact: each set's terms are computed over every row, as a lone runtime `apply` of its list computes them,
        and kept on its samples' rows (a low-rank pass per set, and an output-sized buffer, on layers where several
        sets meet): a sample's output is then bit-equal to that lone apply's at the same batch shape, whatever the
        other samples use (low-rank pairs; CPU BLAS and oneDNN round by row count, so the per-run GEMMs and the
        gated whole-pair form short runs use by default differ from it by float rounding)."""
        from ..mechanisms.sampling.mix import batch

        return batch(self, assignments, strengths, exact)

    def set_region(self, name: str, mask) -> None:
        """Confine a runtime adapter to an image-space mask (H×W, 0..1), per image token (mechanisms/region.py)."""
        from ..mechanisms.sampling.mix import set_region

        set_region(self, name, mask)

    def clear_region(self, name: str) -> None:
        """Apply the adapter everywhere again."""
        from ..mechanisms.sampling.mix import clear_region

        clear_region(self, name)

    def step_schedule(self, total_steps: int):
        """Strengths per sampling step from the adapters' `steps=` windows and ramps (mechanisms/steps.py).

        Sets step 0 at once; pass the result as `callback_on_step_end=` to a diffusers pipeline call."""
        from ..mechanisms.sampling.steps import StepSchedule

        return StepSchedule(self, total_steps)

    @property
    def strengths(self) -> dict[str, float]:
        return dict(self._plan.strengths) if self._plan is not None else dict(self._removed_strengths)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Handle(active={self.active}, {self.report.summary()})"


def _rewrite(entry) -> None:
    """Bring one journal entry to the current strengths."""
    if isinstance(entry, RuntimePath):
        entry.refresh_scales()
    elif isinstance(entry, MergedModule):
        entry.write()
    elif isinstance(entry, ParamPatch):
        entry.rewrite()
    elif isinstance(entry, QuantWrite):  # rewritten from the layer's original tensors: nothing compounds
        entry.write()
        if entry.entry is not None:
            entry.entry.retention, entry.entry.capture, entry.entry.rank = (
                entry.retention,
                entry.capture,
                entry.rank,
            )
