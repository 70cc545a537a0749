"""The decisions every face makes, made once: is the request valid, which mode does `auto` mean, and is the
result refused. `api.apply`, the diffusers drop-in, Ray Serve and the ComfyUI loaders all call these; a face
supplies only the facts that are its own (ComfyUI: whether it holds the base weights quantized) and how a
change is written (its patch list, its injections).

request -> check_mode, check_strengths -> skipped_keys (a model-only request) -> resolve, plan ->
chosen_mode (given the face's fact) -> refuse (trained on other inputs, strict, nothing landed) -> the face
installs -> refuse again on what was installed -> report."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from ..errors import ArgumentError, OtherInputError, StrictApplyError
from ..formats.adapter import Adapter
from ..formats.keys import TEXT_ENCODER_NAMES
from ..modes import APPLY_MODES, ApplyMode
from ..report.coverage import refuse_empty
from ..report.miss import Skipped
from ..report.report import Report, failures
from ..request.spec import finite_strength

WholeModelMode = Literal["merge", "runtime"]
MODEL_ONLY = "model-only"  # why a text-encoder key was skipped
OTHER_INPUT = "other_input"  # the miss kind refuse_other_inputs refuses whatever strict


def check_mode(mode: object) -> ApplyMode:
    """`mode` if it is one of APPLY_MODES; ArgumentError (a ValueError) naming the choices otherwise."""
    if mode not in APPLY_MODES:
        raise ArgumentError(f"mode must be one of {', '.join(APPLY_MODES)}, got {mode!r}")
    return mode  # narrowed to ApplyMode by the membership test


def check_strengths(*values: object, labels: tuple[str, ...] = ()) -> tuple[float, ...]:
    """Each of `values` as a strength by AdapterSpec's rule (finite, |s| <= 1e4, no string or bool), or
    ArgumentError naming its label (`labels`, default "strength")."""
    names = labels or ("strength",) * len(values)
    return tuple(
        finite_strength(v, name)  # type: ignore[arg-type]
        for v, name in zip(values, names, strict=True)
    )


def chosen_mode(mode: ApplyMode, quantized_base: bool) -> WholeModelMode:
    """The one mechanism of a face that installs a whole model one way, given its fact `quantized_base` (the
    base holds its weights quantized). `auto`: runtime there, since a merge would round ΔW into the quantized
    grid (and some storage re-dequantises at every step); merge on floating-point bases. It is the rule
    `mechanisms.choose` follows per layer: no plain merge into quantized storage, merge where it is float."""
    mode = check_mode(mode)
    if mode != "auto":
        return mode
    return "runtime" if quantized_base else "merge"


def skipped_keys(adapters: Iterable[Adapter], model_only: bool) -> list[Skipped]:
    """The keys a request leaves aside on purpose: on a model-only request (no text encoder given to take
    them), every key of the adapters' text-encoder parts, as ComfyUI's LoraLoaderModelOnly skips them. They
    are no misses: the report counts them apart (`Report.skipped`) and strict does not refuse them."""
    if not model_only:
        return []
    return [
        Skipped(adapter.name, key, part.component, MODEL_ONLY)
        for adapter in adapters
        for part in adapter.parts
        if part.component in TEXT_ENCODER_NAMES
        for key in part.keys
    ]


def strict_message(report: Report, where: str = "") -> str:
    """The one wording of a strict refusal: how many keys, where, their miss kinds, whose keys they are."""
    missed = failures(report.unmatched)
    names = sorted({u["adapter"] for u in missed})
    on = f" on {where}" if where else ""
    return f"strict: {len(missed)} keys did not land{on} ({report.kinds()}) of {', '.join(names)}"


def refuse_other_inputs(report: Report) -> None:
    """OtherInputError (carrying `report`) when a key was trained on inputs the model is not fed (miss kind
    `other_input`: a Flux control LoRA's img_in on Flux Fill or Chroma), whatever `strict`: landing it would
    feed its columns other inputs, and the rest of its file would run without the input it was trained on.
    Names each file, its keys and why."""
    found: dict[tuple[str, str], list[str]] = {}
    for u in report.unmatched:
        if u["kind"] == OTHER_INPUT:
            found.setdefault((u["adapter"], u["reason"]), []).append(u["key"])
    if not found:
        return
    files = {str(a["name"]): str(a.get("path") or a["name"]) for a in report.adapters}
    said = "; ".join(
        f"{files.get(name, name)}: {', '.join(keys)}: {why}" for (name, why), keys in found.items()
    )
    raise OtherInputError(
        f"{said}. Trained on inputs this model is not fed, so the rest would run without them; nothing "
        "was changed",
        report,
    )


def refuse_strict(report: Report, strict: bool, where: str = "") -> None:
    """`refuse_other_inputs`, then StrictApplyError (carrying `report`) when `strict` and some key missed;
    `where`: what it was planned on, for the message."""
    refuse_other_inputs(report)
    if strict and failures(report.unmatched):
        raise StrictApplyError(strict_message(report, where), report)


def refuse(report: Report, strict: bool, allow_empty: bool = False, where: str = "") -> None:
    """Refuse a result before (or instead of) keeping it: `refuse_strict` (keys trained on other inputs,
    then strict), then NoKeysLandedError when an adapter landed no key, unless `allow_empty`. Each carries
    `report`."""
    refuse_strict(report, strict, where)
    refuse_empty(report, allow_empty)
