"""How a set is applied: the options `apply` takes and `switch` carries over, checked by one set of rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import ArgumentError
from ..mechanisms.choose import QuantSettings
from ..mechanisms.merge.checks import UndoSettings, check_undo_arguments
from ..mechanisms.merge.undo_source import UndoSource
from ..mechanisms.runtime.compiled import CompileOptions, compile_options
from ..mechanisms.runtime.factor_cache import FactorCache
from ..modes import QUANTIZED, SELECT_MODES, ApplyMode, QuantizedMode, StackMode, UndoKind
from ..stack.combine import validate_stack
from .decide import check_mode


@dataclass
class Options:
    """How a set is applied; apply and switch check them with the same rules (`check`, `layer_mode`)."""

    mode: ApplyMode = "auto"
    stack: StackMode = "sum"
    density: float | None = None
    quantized: QuantizedMode = "auto"
    host_rank: int = 256
    cache: FactorCache | None = None  # hosted factors kept on disk (apply makes a directory one)
    compile_friendly: bool = False
    rank_buckets: Sequence[int] | None = None  # validated by check()
    # compile_friendly: each layer's padded rank so far (id(module) -> rank); a switch never shrinks it
    bucket_floors: dict[int, int] = field(default_factory=dict, compare=False, repr=False)
    undo: UndoKind = "auto"  # merge undo records (mechanisms/merge/undo.py)
    undo_source: UndoSource | None = None
    undo_on_device: bool = False
    undo_with: UndoSettings | None = None  # checked by undo_settings: source files found before any change

    def check(self) -> None:
        check_mode(self.mode)
        validate_stack(self.stack, self.density)
        if self.quantized not in QUANTIZED:
            raise ArgumentError(f"quantized must be one of {QUANTIZED}, got {self.quantized!r}")
        if not isinstance(self.host_rank, int) or self.host_rank < 0:
            raise ArgumentError(f"host_rank must be an int >= 0, got {self.host_rank!r}")
        check_undo_arguments(self.undo, self.undo_source)
        self.compiled()

    def compiled(self) -> CompileOptions | None:
        """The validated compile_friendly settings, or None when not asked for."""
        return compile_options(self.compile_friendly, self.rank_buckets, self.stack)

    @property
    def select(self) -> bool:
        return self.stack in SELECT_MODES

    def layer_mode(self, n_adapters: int) -> ApplyMode:
        """The mode layers get for a set of `n_adapters`: select modes need runtime and exactly two
        adapters."""
        if not self.select:
            return self.mode
        validate_stack(self.stack, self.density, n_adapters)
        if self.mode == "merge":
            raise ArgumentError(
                f"stack={self.stack!r} switches layers between adapters per step: use mode='runtime'"
            )
        return "runtime"

    def quant_settings(self) -> QuantSettings:
        return QuantSettings(self.quantized, self.host_rank, self.cache)
