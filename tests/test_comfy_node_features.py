"""What the LoraWeave nodes offer beyond loading, inside the real ComfyUI v0.19.3 (the pack installed and
loaded by ComfyUI's own custom-node loader, workflows run through its validate_prompt and PromptExecutor): a
tooltip on every widget, the loader's trigger words, block-weight presets."""

from __future__ import annotations

from helpers.comfy_home import comfy_home_fixture  # noqa: F401  (fixture)
from helpers.comfy_pack import NODE_IDS


def info_inputs(inputs: dict) -> dict[str, dict]:
    """input name -> its options, from a V1 input dict (what /object_info sends the frontend), the inputs a
    dynamic combo shows for each of its options included (named `combo.input` as ComfyUI names them)."""
    out = {}
    for section in ("required", "optional"):
        for name, (_, *options) in inputs.get(section, {}).items():
            out[name] = options[0] if options else {}
            for option in out[name].get("options") or []:
                if isinstance(option, dict) and "inputs" in option:
                    nested = info_inputs(option["inputs"])
                    out |= {f"{name}.{key}": value for key, value in nested.items()}
    return out


def test_every_input_of_every_node_has_a_tooltip(comfy_home):
    import nodes

    ours = {k: v for k, v in nodes.NODE_CLASS_MAPPINGS.items() if k.startswith("LoraWeave")}
    assert set(ours) == NODE_IDS
    for node_id, cls in ours.items():
        info = cls.GET_NODE_INFO_V1()
        inputs = info_inputs(info["input"])
        assert inputs, node_id
        bare = sorted(name for name, options in inputs.items() if not str(options.get("tooltip", "")).strip())
        assert not bare, f"{node_id}: no tooltip on {bare}"
        named = [
            t for t, name in zip(info["output_tooltips"], info["output_name"], strict=True) if name.islower()
        ]
        assert all(named), f"{node_id}: a named output without a tooltip: {info['output_name']}"
