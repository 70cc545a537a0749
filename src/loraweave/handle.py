"""What `apply` returns: undo (`remove`), strength changes, switching to another set, select-mode layer choices."""

from __future__ import annotations

import math

from .mechanisms.grow import GrownInput
from .mechanisms.merge import MergedModule
from .mechanisms.quantized import QuantWrite
from .mechanisms.runtime import RuntimePath
from .plan.resolve import Plan
from .plan.weights import AdapterWeights, part_strength
from .report import Report


def finite_strength(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"strength must be a finite number, got {value}")
    return value


class Handle:
    """What `apply` did; `remove()` undoes it exactly. Usable as a context manager."""

    def __init__(self, plan: Plan, report: Report, merged: list[MergedModule], runtime: list[RuntimePath],
                 settings: dict[str, AdapterWeights] | None = None, grown: list[GrownInput] | None = None,
                 quant: list[QuantWrite] | None = None) -> None:
        self._plan = plan
        self.report = report
        self._merged = merged
        self._runtime = runtime
        self._quant = quant or []  # factor-channel, hosted and requantized layers
        self._settings = settings or {name: AdapterWeights(s) for name, s in plan.strengths.items()}
        self._grown = grown or []
        self._select: tuple[str, tuple[str, str]] | None = None  # (mode, (subject, style)) for select modes
        self.quant_options: dict = {}  # apply's quantized/host_rank/cache, reused when a switch starts over
        self.undo_options: dict = {}  # apply's undo/undo_source/undo_on_device, likewise
        self.undo_with = None  # apply's checked undo settings (mechanisms.merge.UndoSettings): switches reuse them
        self._resolve_cache = None  # switching: loads and resolutions per source (plan.cache.ResolveCache)
        self._detached: dict = {}  # switching: paths the last switch took off, by (module id, structure)
        self.last_switch: dict[str, int] | None = None  # kept / reattached / rebuilt / dropped layers
        self.active = True

    def remove(self) -> None:
        """Restore merged weights bit-exactly and detach runtime paths. Idempotent."""
        if not self.active:
            return
        later = [m for m in [*self._merged, *self._quant] if not m.is_top()]
        if later:
            raise RuntimeError(
                f"{len(later)} merged layers were merged again by a later apply; remove that handle first "
                "(merges undo exactly only in reverse order)"
            )
        for merged in self._merged:  # a source file that changed is refused before anything is touched
            merged.check_undo()
        for path in self._runtime:
            path.detach()
        for write in reversed(self._quant):
            write.restore()
        for merged in reversed(self._merged):
            merged.restore()
        for grown in reversed(self._grown):
            grown.restore()
        self.active = False

    def set_strength(self, name: str, value: float, te: float | None = None) -> None:
        """Change one adapter's strength (and, with `te`, its text-encoder strength; else text encoders keep
        theirs when it was set apart, or follow). Runtime: a scale update only. Merge: rewritten from the backup.
        Block weights stay."""
        if name not in self._plan.strengths:
            raise KeyError(f"no adapter named {name!r}; have {sorted(self._plan.strengths)}")
        if not self.active:
            raise RuntimeError("handle was removed")
        if any(name in m.adapters and not m.is_top() for m in [*self._merged, *self._quant]):
            raise RuntimeError("a later apply merged into the same layers; remove it before changing this strength")
        value = finite_strength(float(value))
        for merged in self._merged:
            if name in merged.adapters:
                merged.check_undo(rewrite=True)  # fused (undo='none') or a changed source file: refuse first
        self._plan.strengths[name] = value
        self._settings[name].strength = value
        if te is not None:
            self._settings[name].te_strength = finite_strength(float(te))
        for pp in self._plan.planned:
            if pp.adapter.name == name:
                pp.strength = part_strength(pp, self._settings[name])
        for path in self._runtime:
            if name in path.adapters:
                path.refresh_scales()
        for merged in self._merged:
            if name in merged.adapters:
                merged.write()
        for write in self._quant:
            if name in write.adapters:  # rewritten from the layer's original tensors: nothing compounds
                write.write()
                if write.entry is not None:
                    write.entry.retention, write.entry.capture, write.entry.rank = write.retention, write.capture, write.rank
        for summary in self.report.adapters:
            if summary["name"] == name:
                summary["strength"] = float(value)

    def select_schedule(self, total_steps: int, **kwargs: float):
        """For stack="klora"/"estlora": the per-layer subject->style schedule over `total_steps` sampling steps.

        Use: `s = handle.select_schedule(steps); s.prime(handle)`, then pass
        `callback_on_step_end=s.diffusers_callback(handle)` to the diffusers pipeline call."""
        if self._select is None:
            raise RuntimeError("select_schedule needs apply(..., stack='klora' or 'estlora')")
        from .mechanisms.select import build_schedule

        return build_schedule(self._select[0], self._runtime_by_key(), self._select[1], total_steps, **kwargs)

    def set_layer_choice(self, layer_key: str, index: int) -> None:
        """Select modes: run the subject (0) or the style (1) adapter on one layer from now on."""
        from .mechanisms.select import choose

        if self._select is None:
            raise RuntimeError("set_layer_choice needs apply(..., stack='klora' or 'estlora')")
        paths = self._runtime_by_key()
        if layer_key not in paths:
            raise KeyError(f"no runtime layer {layer_key!r}")
        choose(paths[layer_key], self._select[1], index)

    def _runtime_by_key(self) -> dict[str, RuntimePath]:
        modules = {id(m): f"{c}.{n}" for c, root in self._plan.components for n, m in root.named_modules()}
        return {modules[id(rp.module)]: rp for rp in self._runtime}

    def switch(self, adapters, strength: float = 1.0, stack: str = "sum", density: float | None = None) -> None:
        """Replace the applied set with a new one, touching only layers whose contributions changed.

        Same structure on a layer: re-pointed (runtime: scale update; merge: rewritten only if a strength
        changed). Runtime layers that only lose adapters gate them to 0 (no allocation). `last_switch` counts
        kept / rebuilt / dropped layers. If it fails midway, every adapter is removed and the error raised."""
        from .switching import switch

        switch(self, adapters, strength, stack, density)

    @property
    def strengths(self) -> dict[str, float]:
        return dict(self._plan.strengths)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"Handle(active={self.active}, {self.report.summary()})"
