"""The conditioning LoRA nodes (comfy/conditioning.py): a LoRA on one conditioning, and the model side that
runs every such LoRA in ComfyUI's hook-free batches. Imports ComfyUI at import time (extension.py only)."""

from __future__ import annotations

import math

from comfy_api.latest import io

from .conditioning import conditioning_lora, conditioning_runtime, text_encode_lora
from .lora_files import NONE, file_fingerprint, lora_choices, lora_path, validation_message
from .nodes import STRENGTH, LoraStack, named_errors, schema

NEEDS_RUNTIME = "LoraWeave Conditioning Runtime"


class LoraWeaveConditioningLoRA(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            "LoraWeaveConditioningLoRA",
            "LoraWeave Conditioning LoRA",
            "A LoRA on this conditioning only (a positive prompt, one region's prompt, the negative), from "
            f"start_percent to end_percent of the sampling. Sample with a MODEL through {NEEDS_RUNTIME}: "
            "every conditioning then runs in the batch ComfyUI forms without LoRAs, no weight re-patched.",
            inputs=[
                io.Conditioning.Input(
                    "conditioning", tooltip="The conditioning (prompt, area or mask prompt) the LoRA acts on."
                ),
                io.Combo.Input(
                    "lora_name",
                    options=[*lora_choices(), NONE],  # None: the lora_stack's rows only
                    tooltip="A LoRA or LyCORIS file in ComfyUI's loras folder, for the model being sampled.",
                ),
                io.Float.Input("strength", **STRENGTH),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01),
                LoraStack.Input(  # last and optional: saved workflows load as they were
                    "lora_stack",
                    optional=True,
                    tooltip="More LoRAs on this conditioning, each at its row's model_strength, in the "
                    "same step window (as chaining this node once per row).",
                ),
            ],
            outputs=[
                io.Conditioning.Output(
                    tooltip=f"The conditioning carrying the LoRA: sample it with a MODEL from {NEEDS_RUNTIME}"
                )
            ],
        )

    @classmethod
    def validate_inputs(
        cls, lora_name: str, strength: float, start_percent: float, end_percent: float
    ) -> bool | str:
        if not math.isfinite(strength):
            return f"strength must be a finite number, got {strength}"
        if start_percent >= end_percent:
            return f"start_percent {start_percent} is not before end_percent {end_percent}"
        return True if lora_name == NONE else validation_message(lora_name)

    @classmethod
    def fingerprint_inputs(cls, lora_name: str, **_) -> str:
        return file_fingerprint(lora_name)

    @classmethod
    def execute(
        cls, conditioning, lora_name, strength, start_percent, end_percent, lora_stack=None
    ) -> io.NodeOutput:
        from .stack import stack_rows

        stack = list(lora_stack or [])
        checked = stack_rows(stack, lora_path)  # ArgumentError naming a bad row's index
        rows = [
            (str(raw[0]), row.source, row.model_strength) for raw, row in zip(stack, checked, strict=True)
        ]
        if lora_name != NONE:
            rows.append((lora_name, lora_path(lora_name), strength))
        out = conditioning
        for name, path, value in rows:  # the stack's rows first, as if chained before this node
            with named_errors(name):
                out = conditioning_lora(out, path, value, start_percent, end_percent, label=name)
        return io.NodeOutput(out)


class LoraWeaveConditioningTextEncode(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            "LoraWeaveConditioningTextEncode",
            "LoraWeave Conditioning Text Encode",
            "A prompt encoded with a LoRA's text-encoder part, the conditioning carrying its model part: the "
            "LoRA acts on this prompt only (e.g. the positive; encode the negative with CLIP Text Encode). "
            f"Sample with a MODEL through {NEEDS_RUNTIME}.",
            inputs=[
                io.Clip.Input(
                    "clip", tooltip="The text encoder; the LoRA's text-encoder part goes on a copy."
                ),
                io.String.Input("text", multiline=True, dynamic_prompts=True, tooltip="The prompt."),
                io.Combo.Input(
                    "lora_name",
                    options=lora_choices(),
                    tooltip="A LoRA or LyCORIS file in ComfyUI's loras folder, for the model being sampled.",
                ),
                io.Float.Input("strength", **STRENGTH),
                io.Float.Input("strength_clip", **STRENGTH),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01),
            ],
            outputs=[
                io.Conditioning.Output(
                    tooltip=f"The prompt's conditioning carrying the LoRA: sample it with a MODEL from "
                    f"{NEEDS_RUNTIME}"
                )
            ],
        )

    @classmethod
    def validate_inputs(
        cls, lora_name: str, strength: float, strength_clip: float, start_percent: float, end_percent: float
    ) -> bool | str:
        if not math.isfinite(strength_clip):
            return f"strength_clip must be a finite number, got {strength_clip}"
        return LoraWeaveConditioningLoRA.validate_inputs(lora_name, strength, start_percent, end_percent)

    @classmethod
    def fingerprint_inputs(cls, lora_name: str, **_) -> str:
        return file_fingerprint(lora_name)

    @classmethod
    def execute(
        cls, clip, text, lora_name, strength, strength_clip, start_percent, end_percent
    ) -> io.NodeOutput:
        path = lora_path(lora_name)
        with named_errors(lora_name):
            out = text_encode_lora(
                clip, text, path, strength, strength_clip, start_percent, end_percent, label=lora_name
            )
        return io.NodeOutput(out)


class LoraWeaveConditioningRuntime(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return schema(
            NEEDS_RUNTIME.replace(" ", ""),
            NEEDS_RUNTIME,
            "Runs the LoRAs that LoraWeave Conditioning LoRA nodes put on the conditionings sampled with "
            "this MODEL: each sample of ComfyUI's usual batch with its own LoRAs, in one forward.",
            inputs=[
                io.Model.Input("model"),
                io.Boolean.Input(
                    "core_lora_hooks",
                    default=False,
                    optional=True,
                    tooltip="Also run ComfyUI's own LoRA hooks (Create Hook LoRA, with keyframes) this way: "
                    "one batch, no weight re-patched per hook group. Other hook kinds stay with ComfyUI.",
                ),
            ],
            outputs=[
                io.Model.Output(
                    tooltip="The model, ready for conditionings that carry LoRAs (unchanged else)."
                )
            ],
        )

    @classmethod
    def execute(cls, model, core_lora_hooks=False) -> io.NodeOutput:
        return io.NodeOutput(conditioning_runtime(model, core_lora_hooks))


COND_NODES: list[type[io.ComfyNode]] = [
    LoraWeaveConditioningLoRA,
    LoraWeaveConditioningTextEncode,
    LoraWeaveConditioningRuntime,
]
