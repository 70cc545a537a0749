"""What the LoraWeave nodes offer beyond loading, inside the real ComfyUI v0.19.3 (the pack installed and
loaded by ComfyUI's own custom-node loader, workflows run through its validate_prompt and PromptExecutor): a
tooltip on every widget, the loader's trigger words, block-weight presets."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_pack import FLUX_FILE, NODE_IDS

UNET = {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}}
FALCON = "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"  # ss_tag_frequency of a kohya training
YEW = "leighwoods__public-loras__lora.safetensors"  # ai-toolkit Flux LoRA, one training tag: YEW


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


def _loader(class_type: str, lora_name: str, model: list, **inputs) -> dict:
    strengths = {"strength_model": 0.7} | ({"strength_clip": 1.0} if class_type == "LoraWeaveLoader" else {})
    return {
        "class_type": class_type,
        "inputs": {"model": model, "lora_name": lora_name, **strengths, "mode": "merge", "strict": False},
    }


@pytest.mark.parametrize(
    ("class_type", "report", "triggers"), [("LoraWeaveLoader", 2, 3), ("LoraWeaveLoaderModelOnly", 1, 2)]
)
def test_loaders_output_the_trigger_words_after_their_old_outputs(comfy_home, class_type, report, triggers):
    """The loaders' outputs keep the slots a saved workflow links to (MODEL 0, then report), the trigger
    words come last: what Inspect reads from the same file, through ComfyUI's executor."""
    import nodes

    info = nodes.NODE_CLASS_MAPPINGS[class_type].GET_NODE_INFO_V1()
    assert info["output_name"][report:] == ["report", "trigger_words"], info["output_name"]
    prompt = {
        "1": UNET,
        "2": _loader(class_type, "flux.safetensors", ["1", 0]),
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", report]}},  # as a saved workflow links
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["2", triggers]}},
        "5": {"class_type": "LoraWeaveInspect", "inputs": {"lora_name": "flux.safetensors"}},
    }
    valid, errors, ex, out = run_prompt(prompt, ("2", "5"))
    assert valid and ex.success, errors or execution_error(ex)
    outputs = ex.history_result["outputs"]
    assert "keys_applied=6/6" in outputs["3"]["text"][0]
    assert outputs["4"]["text"][0] == out["2"][triggers] == out["5"][1] == "sks cat, sitting, outdoors"


def most_frequent_tags(path, top: int = 10) -> str:
    """kohya's ss_tag_frequency ({dataset: {tag: count}}) summed over datasets, most frequent first, ties by
    name: read with safetensors' own reader, independent of loraweave."""
    from collections import Counter

    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        datasets = json.loads(f.metadata()["ss_tag_frequency"])
    counts = sum((Counter(tags) for tags in datasets.values()), Counter())
    return ", ".join(t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top])


@pytest.mark.realdata
@pytest.mark.parametrize(("name", "arch"), [(FALCON, "sd15"), (YEW, "flux")])
def test_trigger_words_of_real_files(comfy_home, realdata, monkeypatch, name, arch):
    """Real files through the model-only loader on ComfyUI's own model of their architecture (full size, on
    `meta`): the trigger words output is the file's training tags, most frequent first."""
    import folder_paths
    from helpers.comfy_env import import_comfy
    from helpers.comfy_full import FLUX_DEV, SD15_UNET, meta_patcher
    from helpers.comfy_sampling import REGISTRY, register_test_nodes

    models = import_comfy().supported_models
    config = {"sd15": (models.SD15, SD15_UNET), "flux": (models.Flux, FLUX_DEV)}[arch]
    register_test_nodes(monkeypatch)
    monkeypatch.setitem(REGISTRY, arch, meta_patcher(*config))
    folders, extensions = folder_paths.folder_names_and_paths["loras"]
    monkeypatch.setitem(
        folder_paths.folder_names_and_paths, "loras", ([*folders, str(realdata / "lora")], extensions)
    )
    prompt = {
        "1": {"class_type": "LWTestModelSource", "inputs": {"name": arch}},
        "2": _loader("LoraWeaveLoaderModelOnly", name, ["1", 0]),
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}},
    }
    valid, errors, ex, out = run_prompt(prompt)
    assert valid, errors
    assert ex.success, execution_error(ex)
    want = most_frequent_tags(realdata / "lora" / name)
    assert out["2"][2] == want and want.startswith(
        {FALCON: r"smart falcon \(umamusume\), ", YEW: "YEW"}[name]
    )


BOTH_CHAINS = "both_chains.safetensors"  # a kohya LoRA on both blocks of the tiny Flux: D00 and S00


@pytest.fixture(scope="module")
def both_chains(comfy_home):
    from helpers.comfy_models import tiny_flux
    from helpers.comfy_sampling import kohya_flux_lora
    from safetensors.torch import save_file

    save_file(
        kohya_flux_lora(tiny_flux().patcher, seed=41), comfy_home["base"] / "models/loras" / BOTH_CHAINS
    )
    return BOTH_CHAINS


def applied_weights(lora_name: str, block_weights: str, block_preset: str | None) -> dict:
    """The tiny Flux's targeted weights as ComfyUI loads them after LoraWeave Apply Stack (one row, merge)
    with these block-weight widgets (no block_preset input at all for None: an older saved prompt)."""
    from helpers.comfy_sampling import FLUX_TARGETS

    preset = {} if block_preset is None else {"block_preset": block_preset}
    stack = {"class_type": "LoraWeaveApplyStack", "inputs": {"model": ["1", 0], "lora_stack": ["4", 0],
             "stack_mode": "sum", "block_weights": block_weights, "mode": "merge", **preset}}  # fmt: skip
    prompt = {
        "1": UNET,
        "4": {
            "class_type": "LoraWeaveStack",
            "inputs": {"lora_name": lora_name, "model_strength": 0.9, "clip_strength": 1.0, "enabled": True},
        },  # fmt: skip
        "2": stack,
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}},
    }
    valid, errors, ex, out = run_prompt(prompt)
    assert valid, errors
    assert ex.success, execution_error(ex)
    keys = [f"diffusion_model.{t}.weight" for t in FLUX_TARGETS]
    return {k: out["2"][0].patch_weight_to_device(k, return_weight=True) for k in keys}


# preset -> the same weights as a vector over the tiny Flux's slots (BASE, D00, S00): DOUBLE/SINGLE keep one
# stream; LBW presets stretch their 17 values over the blocks in order (D00 takes entry 1, an input block;
# S00 entry 9, an output block); ALL0.5 halves every slot
PRESET_VECTORS = {
    "DOUBLE": "1,1,0",
    "SINGLE": "1,0,1",
    "OUTALL": "1,0,1",
    "INALL": "1,1,0",
    "ALL0.5": "0.5,0.5,0.5",
}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("preset", "vector"), sorted(PRESET_VECTORS.items()))
def test_a_block_preset_is_its_vector(comfy_home, both_chains, preset, vector):
    by_preset = applied_weights(both_chains, "", preset)
    assert same(by_preset, applied_weights(both_chains, vector, None))
    assert not same(by_preset, applied_weights(both_chains, "", "custom")), "the preset changed nothing"


def test_the_block_weights_text_wins_over_the_preset(comfy_home, both_chains):
    text = applied_weights(both_chains, "1,1,0", "SINGLE")
    assert same(text, applied_weights(both_chains, "1,1,0", None))
    assert not same(text, applied_weights(both_chains, "", "SINGLE"))
