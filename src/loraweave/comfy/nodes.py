"""The LoraWeave nodes for ComfyUI (V3 schema, standard widgets only, so they work under Nodes 2.0).

Node ids and input names are a public contract. Every node names its LoRA by `lora_name` in ComfyUI's "loras"
folders (`lora_files.lora_path` refuses absolute names and `..`); the work is done by `comfy.api`
(load_lora_for_models), `comfy.stack` (apply_stack) and `comfy.steps` (apply_step_window), which return
clones. This module imports ComfyUI at import time: only `comfy.extension.comfy_entrypoint` imports it, inside
ComfyUI.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from comfy_api.latest import io, ui

from ..engine.decide import OTHER_ARCH_OPT_IN
from ..errors import LoraweaveError
from ..modes import APPLY_MODES, STACK_MODES, ApplyMode
from .lora_files import (
    NONE,
    file_fingerprint,
    heatmap_image,
    inspect_text,
    lora_choices,
    lora_path,
    trigger_text,
    validation_message,
)
from .picker import MODEL_UI
from .tooltips import fill_tooltips

log = logging.getLogger("loraweave")

CATEGORY = "loaders/loraweave"
LoraStack = io.Custom(
    "LORA_STACK"
)  # list of (lora_name, model_strength, clip_strength): Efficiency/Easy-Use's
STRENGTH = {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01}
NODE_OTHER_ARCH_OPT_IN = "turn on this node's allow_other_arch to apply it anyway"


def report_text(report, lora: str) -> str:
    """What the node shows: a file of another architecture applied anyway first, loraweave's one-line
    summary, then the misses by kind and the keys skipped on purpose (a model-only node: text encoders); a
    partial load says so first."""
    lines = [f"WARNING: {line}" for line in report.other_arch_lines()]
    if report.keys_total and report.keys_applied < report.keys_total:
        lines.append(f"WARNING: {lora}: {report.keys_applied} of {report.keys_total} keys landed")
    lines.append(f"{lora}: {report.summary()}")
    for component, mechanisms in sorted(report.counts().items()):
        lines.append(f"  {component}: " + ", ".join(f"{m}={n}" for m, n in sorted(mechanisms.items())))
    for kind, count in sorted(report.kinds().items()):
        keys = [u.key for u in report.unmatched if u.kind == kind][:3]
        lines.append(f"  missed {kind}: {count} ({', '.join(keys)}{', ...' if count > len(keys) else ''})")
    for component, count in report.skipped_by_component().items():
        why = ", ".join(sorted({s.why for s in report.skipped if s.component == component}))
        lines.append(f"  skipped {component}={count} ({why})")
    return "\n".join(lines)


class ReportUI(ui.PreviewText):
    """A node's report for its box, with the architecture of the MODEL it ran on (the LoRA picker's marks,
    comfy/picker.py MODEL_UI) where loraweave maps one."""

    def __init__(self, text: str, model=None) -> None:
        from .targets import comfy_arch

        super().__init__(text)
        self.arch = comfy_arch(model) if model is not None else None

    def as_dict(self) -> dict:
        return super().as_dict() | ({MODEL_UI: (self.arch,)} if self.arch else {})


def checked(report, lora: str):
    """The report, a partial one logged. Every loader refused an empty or (strict) incomplete result already,
    through the engine's one rule (engine/decide.py `refuse`), before anything was cloned."""
    if report.keys_applied < report.keys_total:
        log.warning(
            "comfy partial lora=%s keys_applied=%d keys_total=%d",
            lora,
            report.keys_applied,
            report.keys_total,
        )
    return report


def schema(node_id: str, display_name: str, description: str, **fields) -> io.Schema:
    """A node's schema in the pack's category; every input and named output with its tooltip
    (comfy/tooltips.py where the input sets none)."""
    fill_tooltips(node_id, fields.get("inputs", ()), fields.get("outputs", ()))
    return io.Schema(
        node_id=node_id, display_name=display_name, category=CATEGORY, description=description, **fields
    )


def reporting_schema(node_id: str, display_name: str, description: str, **fields) -> io.Schema:
    """The schema of a node that shows its report on itself: an intermediate output, so ComfyUI re-sends the
    report of a cached run (a reloaded page, a changed seed) instead of leaving the node without one."""
    return schema(node_id, display_name, description, has_intermediate_output=True, **fields)


@contextmanager
def named_errors(lora: str) -> Iterator[None]:
    """A loraweave error raised inside names the file as the user chose it (the library names the adapter by
    its stem or full path) and the node's own opt-ins; its type, and `.report` where it has one, stay as they
    were."""
    try:
        yield
    except LoraweaveError as exc:
        if exc.args and isinstance(exc.args[0], str):
            message = exc.args[0].replace(OTHER_ARCH_OPT_IN, NODE_OTHER_ARCH_OPT_IN)
            exc.args = (message if message.startswith(lora) else f"{lora}: {message}", *exc.args[1:])
        raise


def _lora_input(optional: bool = False) -> io.Combo.Input:
    return io.Combo.Input(
        "lora_name",
        options=lora_choices(with_none=optional),
        tooltip="A LoRA or LyCORIS file in ComfyUI's loras folder, from any trainer (kohya, diffusers, "
        "PEFT, ai-toolkit, LyCORIS, ...).",
    )


def _trigger_words_output() -> io.String.Output:
    """The file's trigger words (comma-joined): a loader's last output, so the slots saved workflows link to
    stay where they were."""
    return io.String.Output(display_name="trigger_words")


def _mode_input() -> io.Combo.Input:
    return io.Combo.Input(
        "mode",
        options=list(APPLY_MODES),
        default="auto",
        tooltip="merge: the LoRA is added into the model's weights, as core's loader does; runtime: the "
        "weights stay as they are and the LoRA runs beside them, so a strength change or a swap is quick; "
        "auto: merge, unless the model's weights are quantized in a way merge cannot write.",
    )


def _strict_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "strict",
        default=False,
        tooltip="On: stop with an error when any part of the file finds no layer in the model; off: apply "
        "what fits and list the rest in the report.",
    )


def block_preset_input() -> io.Combo.Input:
    from ..arch.blocks import preset_names
    from .stack import CUSTOM_BLOCKS

    return io.Combo.Input(
        "block_preset",
        options=[CUSTOM_BLOCKS, *preset_names()],
        default=CUSTOM_BLOCKS,
        optional=True,
        tooltip=f"Block weights by name, used when block_weights is empty ({CUSTOM_BLOCKS}: every block at "
        "1). ALL, NONE and ALL0.5 weigh every block alike; INS/IND keep the shallow/deep input blocks, MIDD "
        "the deep blocks and the middle, OUTD/OUTS the deep/shallow output blocks, INALL/OUTALL one side "
        "(on DiTs these follow the block order); DOUBLE/SINGLE keep one stream of Flux-like models.",
    )


def _other_arch_input() -> io.Boolean.Input:
    return io.Boolean.Input(
        "allow_other_arch",
        default=False,
        optional=True,
        tooltip="Apply a file whose keys say it was trained for another architecture than the model's (an "
        "SD2 LoRA on an SD1.5 model). Off: the node stops with an error; on: the report says so.",
    )


def _modality_inputs() -> list[io.Float.Input]:
    # last and optional: saved workflows load as they were
    return [io.Float.Input(f"{m}_strength", optional=True, **STRENGTH) for m in ("video", "audio", "cross")]


class LoraFileNode(io.ComfyNode):
    """A node that reads one file of the loras folders: refused at queue time when the name is bad or the file
    is missing or broken; re-run when the file changes."""

    @classmethod
    def validate_inputs(cls, lora_name: str) -> bool | str:
        return validation_message(lora_name)

    @classmethod
    def fingerprint_inputs(cls, lora_name: str, **_) -> str:
        return file_fingerprint(lora_name)


def load_one(
    model,
    clip,
    lora_name: str,
    strength_model: float,
    strength_clip: float,
    mode: ApplyMode,
    strict: bool,
    allow_other_arch: bool = False,
    modalities: tuple[float, float, float] = (1.0, 1.0, 1.0),
):
    """(model, clip, report text) from c1's load_lora_for_models on the named file; clones, inputs
    untouched. `modalities`: the video, audio and cross-modal strength widgets."""
    from ..resolve.modality import modality_request
    from .api import load_lora_for_models

    with named_errors(lora_name):
        wanted = modality_request(*modalities)
        path = lora_path(lora_name)
        model, clip, report = load_lora_for_models(
            model, clip, path, strength_model, strength_clip, mode, strict, allow_other_arch, wanted
        )
        return model, clip, report_text(checked(report, lora_name), lora_name)


class LoraWeaveLoader(LoraFileNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return reporting_schema(
            "LoraWeaveLoader",
            "LoraWeave Loader",
            "Apply a LoRA/LyCORIS file of any layout to MODEL and CLIP; shows what landed.",
            inputs=[
                io.Model.Input("model"),
                io.Clip.Input("clip", optional=True),
                _lora_input(),
                io.Float.Input("strength_model", **STRENGTH),
                io.Float.Input("strength_clip", **STRENGTH),
                _mode_input(),
                _strict_input(),
                _other_arch_input(),
                *_modality_inputs(),
            ],
            outputs=[
                io.Model.Output(),
                io.Clip.Output(),
                io.String.Output(display_name="report"),
                _trigger_words_output(),
            ],
        )

    @classmethod
    def execute(
        cls,
        model,
        lora_name,
        strength_model,
        strength_clip,
        mode,
        strict,
        clip=None,
        allow_other_arch=False,
        video_strength=1.0,
        audio_strength=1.0,
        cross_strength=1.0,
    ) -> io.NodeOutput:
        modalities = (video_strength, audio_strength, cross_strength)
        model, clip, text = load_one(
            model, clip, lora_name, strength_model, strength_clip, mode, strict, allow_other_arch, modalities
        )
        triggers = trigger_text(lora_path(lora_name))
        return io.NodeOutput(model, clip, text, triggers, ui=ReportUI(text, model))


class LoraWeaveLoaderModelOnly(LoraFileNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return reporting_schema(
            "LoraWeaveLoaderModelOnly",
            "LoraWeave Loader (model only)",
            "Apply a LoRA/LyCORIS file of any layout to MODEL; shows what landed.",
            inputs=[
                io.Model.Input("model"),
                _lora_input(),
                io.Float.Input("strength_model", **STRENGTH),
                _mode_input(),
                _strict_input(),
                _other_arch_input(),
                *_modality_inputs(),
            ],
            outputs=[io.Model.Output(), io.String.Output(display_name="report"), _trigger_words_output()],
        )

    @classmethod
    def execute(
        cls,
        model,
        lora_name,
        strength_model,
        mode,
        strict,
        allow_other_arch=False,
        video_strength=1.0,
        audio_strength=1.0,
        cross_strength=1.0,
    ) -> io.NodeOutput:
        modalities = (video_strength, audio_strength, cross_strength)
        model, _, text = load_one(
            model, None, lora_name, strength_model, 0.0, mode, strict, allow_other_arch, modalities
        )
        triggers = trigger_text(lora_path(lora_name))
        return io.NodeOutput(model, text, triggers, ui=ReportUI(text, model))


class LoraWeaveStack(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            "LoraWeaveStack",
            "LoraWeave Stack",
            "One row of a LORA_STACK: chain rows, then apply them with LoraWeave Apply Stack "
            "(or any loader that takes LORA_STACK).",
            inputs=[
                _lora_input(optional=True),
                io.Float.Input("model_strength", **STRENGTH),
                io.Float.Input("clip_strength", **STRENGTH),
                io.Boolean.Input(
                    "enabled",
                    default=True,
                    tooltip="Off: this row is left out; the stack passes on unchanged.",
                ),
                LoraStack.Input("lora_stack", optional=True),
            ],
            outputs=[LoraStack.Output(display_name="LORA_STACK")],
        )

    @classmethod
    def validate_inputs(cls, lora_name: str) -> bool | str:
        return True if lora_name == NONE else validation_message(lora_name)

    @classmethod
    def execute(cls, lora_name, model_strength, clip_strength, enabled, lora_stack=None) -> io.NodeOutput:
        rows = list(lora_stack or [])  # a new list: the upstream node's cached output stays as it was
        if enabled and lora_name != NONE:
            rows.append((lora_name, float(model_strength), float(clip_strength)))
        return io.NodeOutput(rows)


class LoraWeaveApplyStack(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return reporting_schema(
            "LoraWeaveApplyStack",
            "LoraWeave Apply Stack",
            "Apply a LORA_STACK (ours or another pack's) with a stack mode and block weights.",
            inputs=[
                io.Model.Input("model"),
                io.Clip.Input("clip", optional=True),
                LoraStack.Input("lora_stack"),
                io.Combo.Input("stack_mode", options=list(STACK_MODES), default="sum"),
                io.String.Input(
                    "block_weights",
                    default="",
                    tooltip="How strongly each block of the model takes the LoRAs: empty for every block "
                    "at 1 (or the block_preset), a preset name (e.g. INALL, DOUBLE), or comma-separated "
                    "weights, one per block of the model's architecture.",
                ),
                _mode_input(),
                block_preset_input(),  # last and optional: saved workflows and prompts load as they were
                _other_arch_input(),
            ],
            outputs=[io.Model.Output(), io.Clip.Output(), io.String.Output(display_name="report")],
        )

    @classmethod
    def execute(
        cls,
        model,
        lora_stack,
        stack_mode,
        block_weights,
        mode,
        clip=None,
        block_preset=None,
        allow_other_arch=False,
    ) -> io.NodeOutput:
        from .stack import apply_stack, chosen_block_weights, stack_rows

        rows = stack_rows(lora_stack, lora_path)
        if not rows:
            text = "empty LORA_STACK: nothing applied"
            return io.NodeOutput(model, clip, text, ui=ReportUI(text, model))
        names = ", ".join(str(r[0]) for r in lora_stack)
        with named_errors(names):
            model, clip, report = apply_stack(
                model,
                clip,
                rows,
                stack_mode=stack_mode,
                block_weights=chosen_block_weights(block_weights, block_preset),
                mode=mode,
                allow_other_arch=allow_other_arch,
            )
            text = report_text(checked(report, names), names)
        return io.NodeOutput(model, clip, text, ui=ReportUI(text, model))


class LoraWeaveStepWindow(LoraFileNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return reporting_schema(
            "LoraWeaveStepWindow",
            "LoraWeave Step Window",
            "A LoRA active only from start_percent to end_percent of the sampling, with an optional "
            "ramp; applied at runtime, no weight is re-merged.",
            inputs=[
                io.Model.Input("model"),
                _lora_input(),
                io.Float.Input("strength", **STRENGTH),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01),
                io.Float.Input(
                    "ramp",
                    default=0.0,
                    min=0.0,
                    max=1.0,
                    step=0.01,
                    tooltip="How gradually the LoRA fades in after start_percent and out before end_percent, "
                    "as a fraction of the sampling (0: on and off at once).",
                ),
                _other_arch_input(),
            ],
            outputs=[io.Model.Output(), io.String.Output(display_name="report")],
        )

    @classmethod
    # ComfyUI flags every input this signature names with its message, and checks the others itself
    # (lora_name: one of the listed files); the override narrows by design
    def validate_inputs(cls, start_percent: float, end_percent: float) -> bool | str:  # type: ignore[override]
        if start_percent > end_percent:
            return f"start_percent {start_percent} is after end_percent {end_percent}"
        return True

    @classmethod
    def execute(
        cls, model, lora_name, strength, start_percent, end_percent, ramp, allow_other_arch=False
    ) -> io.NodeOutput:
        from .steps import apply_step_window

        path = lora_path(lora_name)
        with named_errors(lora_name):
            model, report = apply_step_window(
                model, path, strength, start_percent, end_percent, ramp, allow_other_arch
            )
            text = report_text(checked(report, lora_name), lora_name)
        text += f"\n  active from {start_percent:g} to {end_percent:g} of the steps, ramp {ramp:g}"
        return io.NodeOutput(model, text, ui=ReportUI(text, model))


class LoraWeaveInspect(LoraFileNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            "LoraWeaveInspect",
            "LoraWeave Inspect",
            "What a LoRA file is (layout, families, ranks, architecture, coverage), its trigger "
            "words, and the heatmap of its ||dW|| per block x module kind.",
            is_output_node=True,
            inputs=[
                _lora_input(),
                io.Model.Input(
                    "model",
                    optional=True,
                    tooltip="connected: coverage is judged on this model's own modules (a pruned, distilled "
                    "or tiny model); unconnected: on the full-size model of the file's architecture",
                ),
                io.Clip.Input(
                    "clip",
                    optional=True,
                    tooltip="with a MODEL: the text-encoder keys are judged on this CLIP; a MODEL alone: "
                    "they are skipped, as the model-only loader skips them",
                ),
            ],
            outputs=[
                io.String.Output(display_name="report"),
                io.String.Output(display_name="trigger_words"),
                io.Image.Output(display_name="heatmap"),
            ],
        )

    @classmethod
    def execute(cls, lora_name, model=None, clip=None) -> io.NodeOutput:
        path = lora_path(lora_name)
        try:
            with named_errors(lora_name):
                text, triggers = inspect_text(path, lora_name, model, clip), trigger_text(path)
                heatmap, why_none = heatmap_image(path)
                text += f"\n{why_none}" if why_none else ""
        except ModuleNotFoundError as exc:  # ComfyUI does not ship diffusers; the comfy extra does
            raise LoraweaveError(
                f"{lora_name}: LoraWeave Inspect resolves the file on the architecture's skeleton, built "
                f"from diffusers' classes, and needs {exc.name}: pip install 'loraweave[comfy]' into "
                f"ComfyUI's Python"
            ) from exc
        return io.NodeOutput(text, triggers, heatmap, ui=ReportUI(text, model))


NODES: list[type[io.ComfyNode]] = [
    LoraWeaveLoader,
    LoraWeaveLoaderModelOnly,
    LoraWeaveStack,
    LoraWeaveApplyStack,
    LoraWeaveStepWindow,
    LoraWeaveInspect,
]
