"""The conditioning LoRA nodes (comfy/conditioning.py): a LoRA on one conditioning, and the model side that
runs every such LoRA in ComfyUI's hook-free batches. Imports ComfyUI at import time (extension.py only)."""

from __future__ import annotations

import math

from comfy_api.latest import io

from .conditioning import conditioning_lora, conditioning_runtime
from .lora_files import file_fingerprint, lora_choices, lora_path, validation_message
from .nodes import STRENGTH, named_errors, schema

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
                    options=lora_choices(),
                    tooltip="A LoRA or LyCORIS file in ComfyUI's loras folder, for the model being sampled.",
                ),
                io.Float.Input("strength", **STRENGTH),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01),
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
        return validation_message(lora_name)

    @classmethod
    def fingerprint_inputs(cls, lora_name: str, **_) -> str:
        return file_fingerprint(lora_name)

    @classmethod
    def execute(cls, conditioning, lora_name, strength, start_percent, end_percent) -> io.NodeOutput:
        path = lora_path(lora_name)
        with named_errors(lora_name):
            out = conditioning_lora(conditioning, path, strength, start_percent, end_percent, label=lora_name)
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


COND_NODES: list[type[io.ComfyNode]] = [LoraWeaveConditioningLoRA, LoraWeaveConditioningRuntime]
