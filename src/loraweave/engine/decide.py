"""The decisions every face makes, made once: is the request valid, which mode does `auto` mean, and is the
result refused. `api.apply`, the diffusers drop-in, Ray Serve and the ComfyUI loaders all call these; a face
supplies only the facts that are its own (ComfyUI: whether it holds the base weights quantized) and how a
change is written (its patch list, its injections).

request -> check_mode, check_strengths -> skipped_keys (a model-only request) -> read -> arch_check (given
the face's fact: the model's architecture) -> resolve, plan -> chosen_mode (given the face's fact) -> refuse
(another architecture's file, trained on other inputs, strict, nothing landed) -> the face installs -> refuse
again on what was installed -> report (note_other_arch: what was let through, said loudly)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ..arch.fit import FileArch, ModelArch, file_arch, label, module_arch, with_article
from ..errors import (
    ArgumentError,
    ArgumentTypeError,
    OtherInputError,
    StrictApplyError,
    WrongArchitectureError,
)
from ..formats.adapter import Adapter
from ..formats.keys import TEXT_ENCODER_NAMES
from ..modes import APPLY_MODES, ApplyMode
from ..report.coverage import EMPTY_OPT_IN, refuse_empty
from ..report.miss import Skipped
from ..report.report import Report, failures
from ..request.spec import finite_strength
from ..resolve.target import Components

log = logging.getLogger("loraweave")
WholeModelMode = Literal["merge", "runtime"]
MODEL_ONLY = "model-only"  # why a text-encoder key was skipped
OTHER_INPUT = "other_input"  # the miss kind refuse_other_inputs refuses whatever strict
# How the Python faces offer allow_other_arch; the ComfyUI nodes and the CLI say it in their own words.
OTHER_ARCH_OPT_IN = "pass allow_other_arch=True to apply it anyway"


@dataclass(frozen=True)
class OptIns:
    """How a face offers the refusals' opt-ins, for their messages (None: the face has no such opt-in)."""

    allow_empty: str | None = EMPTY_OPT_IN
    allow_other_arch: str = OTHER_ARCH_OPT_IN


PYTHON = OptIns()  # apply: allow_empty=True, allow_other_arch=True
COMFY = OptIns(allow_empty=None)  # loraweave.comfy and its nodes: no allow_empty


@dataclass(frozen=True)
class OtherArch:
    """A file whose keys and shapes say it is for `file_arch`, applied to a model of `model_arch`."""

    adapter: str  # the file's name (the adapter's name for a state dict)
    file_arch: str
    model_arch: str
    name: str = ""  # the adapter's name and path, as the report's adapter entries hold them
    path: str | None = None

    def words(self) -> str:
        """In users' terms: "an SD2 LoRA on an SD1.5 model"."""
        file, model = with_article(label(self.file_arch)), with_article(label(self.model_arch))
        return f"{file} LoRA on {model} model"

    def to_dict(self) -> dict[str, str]:
        return {
            "adapter": self.adapter,
            "file_arch": self.file_arch,
            "model_arch": self.model_arch,
            "words": self.words(),
        }


# Misses that say nothing about the file's fit: keys a sibling variant takes, a component not given (no CLIP).
NOT_A_MISFIT = ("expected_absent", "no_such_component")


@dataclass(frozen=True)
class ArchCheck:
    """The files of a request whose detected architecture the model does not take (`suspects`), and whether
    the caller opted in to apply them anyway. A suspect every key of which lands is no other architecture's
    in fact (its shapes fit this model, whatever its names resemble), so only the others are refused."""

    suspects: tuple[OtherArch, ...] = ()
    allowed: bool = False

    def against(self, report: Report) -> list[OtherArch]:
        """The suspects that did not land whole in `report`."""
        if not self.suspects:
            return []
        whole: set[str] = set()
        for summary in report.adapters:
            misfits = [
                u
                for u in report.unmatched
                if u["adapter"] == summary["name"] and u["kind"] not in NOT_A_MISFIT
            ]
            if summary["keys_applied"] and not misfits:
                whole |= {str(summary["name"]), str(summary["path"])}
        return [o for o in self.suspects if o.name not in whole and str(o.path) not in whole]


NO_ARCH_CHECK = ArchCheck()


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


def refuse(
    report: Report,
    strict: bool,
    allow_empty: bool = False,
    where: str = "",
    opt_ins: OptIns = PYTHON,
    arch: ArchCheck = NO_ARCH_CHECK,
) -> None:
    """Refuse a result before (or instead of) keeping it: files of another architecture than the model's
    (`arch`, from `arch_check`) unless the caller opted in, `refuse_strict` (keys trained on other inputs,
    then strict), then NoKeysLandedError when an adapter landed no key, unless `allow_empty`. Each carries
    `report`; `opt_ins`: how the face offers them."""
    found = arch.against(report)
    if found and not arch.allowed:
        raise WrongArchitectureError(
            other_arch_message(found, opt_ins.allow_other_arch), [o.to_dict() for o in found], report
        )
    refuse_strict(report, strict, where)
    refuse_empty(report, allow_empty, opt_ins.allow_empty)


def _file_name(adapter: Adapter) -> str:
    return os.path.basename(str(adapter.path)) if adapter.path else adapter.name


def fits_model(found: FileArch | None, model: ModelArch | None) -> bool | None:
    """Whether a file detected as `found` (arch/fit.py `file_arch`) is for `model`: False when the model
    takes none of the architectures it may be; None where either side is unsure (never refused, never
    marked)."""
    if found is None or model is None:
        return None
    return bool(found.possible & model.takes)


def model_arch_of(components: Components) -> ModelArch | None:
    """The architecture of the target's denoiser (None: no denoiser, or one loraweave maps no record onto)."""
    denoiser = components.modules.get(components.denoiser_name) if components.denoiser_name else None
    return module_arch(denoiser) if denoiser is not None else None


def arch_check(adapters: Iterable[Adapter], model: ModelArch | None, allow_other_arch: bool) -> ArchCheck:
    """The adapters whose files' keys and shapes name an architecture the model does not take as its own, for
    `refuse` and `note_other_arch`. The face supplies `model` (its own fact: ComfyUI's model class, a
    diffusers module); the files' side is detected here, as `inspect` detects it. Nothing is said where either
    side is unsure: a model loraweave maps no architecture onto (`model` None), a file whose detection names
    no one model (arch/fit.py)."""
    if not isinstance(allow_other_arch, bool):
        raise ArgumentTypeError(f"allow_other_arch must be True or False, got {allow_other_arch!r}")
    if model is None:
        return ArchCheck(allowed=allow_other_arch)
    suspects = []
    for adapter in adapters:
        found = file_arch(adapter)
        if found is not None and fits_model(found, model) is False:
            path = str(adapter.path) if adapter.path else None
            suspects.append(OtherArch(_file_name(adapter), found.name, model.name, adapter.name, path))
    return ArchCheck(tuple(suspects), allow_other_arch)


def other_arch_message(found: list[OtherArch], opt_in: str = OTHER_ARCH_OPT_IN) -> str:
    """The one wording of the refusal: each file in users' terms, then what to do (`opt_in`: the face's)."""
    said = "; ".join(f"{o.adapter}: {o.words()}" for o in found)
    return (
        f"{said}. Its keys and shapes say so (`loraweave inspect` shows the evidence) and only the layers "
        f"whose shapes happen to fit would change, so nothing was changed. Load the model it was trained "
        f"for, or {opt_in}."
    )


def note_other_arch(report: Report, arch: ArchCheck) -> None:
    """Say loudly what `refuse` let through on the caller's opt-in: in the report (its summary, its dict,
    the lines a node shows) and one WARNING per file."""
    found = arch.against(report)
    report.other_arch = [o.to_dict() for o in found]
    for o in found:
        log.warning(
            "loraweave other_arch adapter=%r file_arch=%s model_arch=%s: %s, applied anyway "
            "(allow_other_arch)",
            o.adapter,
            o.file_arch,
            o.model_arch,
            o.words(),
        )
