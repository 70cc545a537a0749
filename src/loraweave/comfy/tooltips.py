"""What each LoraWeave widget and output does, in the words of a ComfyUI user: the tooltips ComfyUI shows on
hover (classic canvas and Nodes 2.0). A node that sets a tooltip where it declares the input keeps its own;
`fill_tooltips` gives every other input and named output the text below (by node, then by name)."""

from __future__ import annotations

from collections.abc import Iterable

# input id -> tooltip, for every node that has an input of that name
INPUTS: dict[str, str] = {
    "model": "The diffusion model to add the LoRA to (from a checkpoint or diffusion-model loader).",
    "clip": "The text encoder to add the LoRA's text-encoder part to; leave unconnected to change only the "
    "model.",
    "lora_name": "A LoRA or LyCORIS file in ComfyUI's loras folder, from any trainer.",
    "strength_model": "How strongly the LoRA changes the model: 1 as trained, 0 off, negative inverts it.",
    "strength_clip": "How strongly the LoRA changes the text encoder: 1 as trained, 0 off, negative inverts "
    "it.",
    "model_strength": "How strongly this LoRA changes the model: 1 as trained, 0 off, negative inverts it.",
    "clip_strength": "How strongly this LoRA changes the text encoder: 1 as trained, 0 off, negative inverts "
    "it.",
    "strength": "How strongly the LoRA changes the model while it is active: 1 as trained, 0 off.",
    "stack_mode": "How LoRAs that change the same layer are combined: sum adds them as separate loaders "
    "would; ties, dare_ties, dare_linear and magnitude_prune merge them into one change with fewer "
    "conflicts. klora and estlora pick LoRAs per sampling step and are not available here.",
    "start_percent": "When the LoRA switches on, as a fraction of the sampling: 0 from the first step, 0.5 "
    "from halfway.",
    "end_percent": "When the LoRA switches off, as a fraction of the sampling: 1 at the last step.",
    "video_strength": "Audio-video models (LTX-2, MiniMax-H3): how strongly the LoRA changes the video "
    "modules, times strength_model. Leave all three at 1 on other models.",
    "audio_strength": "Audio-video models (LTX-2, MiniMax-H3): how strongly the LoRA changes the audio "
    "modules, times strength_model; 0 keeps the sound as the model makes it.",
    "cross_strength": "Audio-video models (LTX-2, MiniMax-H3): how strongly the LoRA changes the modules "
    "that join audio and video (LTX-2's cross-attention, MiniMax-H3's joint blocks).",
}

# (node id, input id) -> tooltip, where one node means something of its own by a shared name
NODE_INPUTS: dict[tuple[str, str], str] = {
    (
        "LoraWeaveStack",
        "lora_stack",
    ): "Rows from earlier LoraWeave Stack nodes (or another pack's LORA_STACK) to add this row to.",
    ("LoraWeaveApplyStack", "lora_stack"): "The LoRAs to apply: a LORA_STACK from LoraWeave Stack nodes or "
    "from another pack's stack node.",
    ("LoraWeaveInspect", "lora_name"): "The LoRA or LyCORIS file in ComfyUI's loras folder to describe.",
}

# output display name -> tooltip
OUTPUTS: dict[str, str] = {
    "report": "What the node did, as text: how many of the file's keys landed on each part of the model, "
    "and the ones that did not.",
    "trigger_words": "The words the LoRA was trained with, read from the file's metadata, most used first "
    "and comma-separated; empty when the file names none.",
    "heatmap": "How much the LoRA changes each block of the model, per kind of layer, as an image.",
    "LORA_STACK": "This row added to the incoming rows: connect it to another Stack node or to LoraWeave "
    "Apply Stack.",
}


def fill_tooltips(node_id: str, inputs: Iterable, outputs: Iterable = ()) -> None:
    """Give each input and output of a schema without a tooltip its text from the tables above (in place);
    the inputs a dynamic combo shows per option are filled the same way."""
    for item in inputs:
        if not item.tooltip:
            item.tooltip = NODE_INPUTS.get((node_id, item.id)) or INPUTS.get(item.id)
        fill_tooltips(node_id, option_inputs(item))
    for out in outputs:
        if not out.tooltip:
            out.tooltip = OUTPUTS.get(out.display_name or "")


def option_inputs(item) -> list:
    """The inputs a dynamic combo (io.DynamicCombo.Input) shows for its options; [] for any other input."""
    options = getattr(item, "options", None) or ()
    return [nested for option in options for nested in getattr(option, "inputs", ())]
