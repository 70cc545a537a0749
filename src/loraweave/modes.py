"""The names the library's modes take, declared once: each `Literal` alias types the signatures, and the tuple
beside it (derived with `get_args`, never spelled twice) is what runtime checks test membership against."""

from __future__ import annotations

from typing import Literal, get_args

ApplyMode = Literal["auto", "merge", "runtime"]
DenseStackMode = Literal["ties", "dare_ties", "dare_linear", "magnitude_prune"]
SelectStackMode = Literal["klora", "estlora"]
StackMode = Literal["sum", DenseStackMode, SelectStackMode]
UndoKind = Literal["auto", "compact", "copy", "source", "none"]
QuantizedMode = Literal["auto", "host", "requantize"]
QuantMechanism = Literal["factor", "hosted", "requantize"]
# What a layer gets: merged, a runtime path, or a quantized layer's write; "planned" is `plan`'s report only.
Mechanism = Literal["merge", "runtime", QuantMechanism]
ReportMechanism = Literal[Mechanism, "planned"]

APPLY_MODES: tuple[ApplyMode, ...] = get_args(ApplyMode)
STACK_MODES: tuple[StackMode, ...] = get_args(StackMode)
DENSE_MODES: tuple[DenseStackMode, ...] = get_args(DenseStackMode)
SELECT_MODES: tuple[SelectStackMode, ...] = get_args(SelectStackMode)
UNDO_KINDS: tuple[UndoKind, ...] = get_args(UndoKind)
QUANTIZED: tuple[QuantizedMode, ...] = get_args(QuantizedMode)
QUANT_MECHANISMS: tuple[QuantMechanism, ...] = get_args(QuantMechanism)
MECHANISMS: tuple[Mechanism, ...] = get_args(Mechanism)
REPORT_MECHANISMS: tuple[ReportMechanism, ...] = get_args(ReportMechanism)
