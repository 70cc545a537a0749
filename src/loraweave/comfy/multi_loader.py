"""LoraWeave Multi Loader: many LoRAs in one node, one row each (on/off, file, model and text-encoder
strength), with standard widgets only so it works under Nodes 2.0.

The number of rows is a dynamic combo (ComfyUI's `io.DynamicCombo`, as core's own nodes take a count of
entries): picking 3 shows rows 1 to 3. The rows that are on and name a file become LORA_STACK rows and go
through `comfy.stack` (stack_rows, apply_stack) like LoraWeave Apply Stack: one reader, one decision path.
This module imports ComfyUI at import time: only `comfy.extension` imports it, inside ComfyUI."""

from __future__ import annotations

from typing import NamedTuple

from comfy_api.latest import io

from .lora_files import NONE, file_fingerprint, lora_choices, lora_path, trigger_text
from .nodes import (
    STRENGTH,
    ReportUI,
    _mode_input,
    _other_arch_input,
    checked,
    named_errors,
    report_text,
    reporting_schema,
)

MAX_ROWS = 8  # each count lists its rows in /object_info (with the file list): 36 row sets in all
ROWS = "loras"  # the row-count combo; its rows arrive under this name as one dict


class Row(NamedTuple):
    """One row of the node as the user set it."""

    number: int  # 1-based, as the widgets name it
    on: bool
    lora_name: str
    model_strength: float
    clip_strength: float

    @property
    def active(self) -> bool:
        return self.on and self.lora_name != NONE

    def line(self) -> str:
        """The row as the report lists it."""
        if self.lora_name == NONE:
            return f"row {self.number}: no file"
        strengths = f"model {self.model_strength:g}, clip {self.clip_strength:g}"
        return f"row {self.number}: {self.lora_name} ({strengths})" + ("" if self.on else ": off")


def row_inputs(index: int) -> list[io.Input]:
    """The widgets of row `index` (1-based): on, lora, model strength, clip strength."""
    return [
        io.Boolean.Input(f"on_{index}", default=True, tooltip=f"Off: row {index} is not applied."),
        io.Combo.Input(
            f"lora_{index}",
            options=lora_choices(with_none=True),
            default=NONE,
            tooltip=f"The LoRA or LyCORIS file of row {index}, from ComfyUI's loras folder; None: no file.",
        ),
        io.Float.Input(
            f"strength_model_{index}",
            **STRENGTH,
            tooltip=f"How strongly row {index}'s LoRA changes the model: 1 as trained, 0 off.",
        ),
        io.Float.Input(
            f"strength_clip_{index}",
            **STRENGTH,
            tooltip=f"How strongly row {index}'s LoRA changes the text encoder: 1 as trained, 0 off.",
        ),
    ]


def rows_of(values: dict) -> list[Row]:
    """The rows the row count shows, from the dict ComfyUI hands the node under ROWS."""
    count = int(values[ROWS])
    return [
        Row(
            i,
            bool(values[f"on_{i}"]),
            values[f"lora_{i}"],
            float(values[f"strength_model_{i}"]),
            float(values[f"strength_clip_{i}"]),
        )
        for i in range(1, count + 1)
    ]


class LoraWeaveMultiLoader(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        counts = [
            io.DynamicCombo.Option(str(n), [i for k in range(1, n + 1) for i in row_inputs(k)])
            for n in range(1, MAX_ROWS + 1)
        ]
        return reporting_schema(
            "LoraWeaveMultiLoader",
            "LoraWeave Multi Loader",
            "Apply several LoRA/LyCORIS files to MODEL and CLIP, one row each with its own strengths; "
            "switch a row off to leave it out. Shows what landed.",
            inputs=[
                io.Model.Input("model"),
                io.Clip.Input("clip", optional=True),
                io.DynamicCombo.Input(
                    ROWS, options=counts, display_name="rows", tooltip="How many LoRA rows the node shows."
                ),
                _mode_input(),
                _other_arch_input(),
            ],
            outputs=[
                io.Model.Output(),
                io.Clip.Output(),
                io.String.Output(display_name="report"),
                io.String.Output(display_name="trigger_words"),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, loras: dict, **_) -> str:
        """Changes when a file an active row names may have (comfy.lora_files.file_fingerprint)."""
        return "|".join(file_fingerprint(r.lora_name) for r in rows_of(loras) if r.active)

    @classmethod
    def execute(cls, model, loras: dict, mode, clip=None, allow_other_arch=False) -> io.NodeOutput:
        from .stack import apply_stack, stack_rows

        rows = rows_of(loras)
        active = [r for r in rows if r.active]
        listing = "\n".join(r.line() for r in rows)
        if not active:
            text = f"{listing}\nno row is on: nothing applied"
            return io.NodeOutput(model, clip, text, "", ui=ReportUI(text, model))
        stack = [(r.lora_name, r.model_strength, r.clip_strength) for r in active]
        names = ", ".join(r.lora_name for r in active)
        with named_errors(names):
            model, clip, report = apply_stack(
                model, clip, stack_rows(stack, lora_path), mode=mode, allow_other_arch=allow_other_arch
            )
            text = f"{listing}\n{report_text(checked(report, names), names)}"
        triggers = ", ".join(t for t in (trigger_text(lora_path(r.lora_name)) for r in active) if t)
        return io.NodeOutput(model, clip, text, triggers, ui=ReportUI(text, model))
