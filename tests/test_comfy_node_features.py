"""What the LoraWeave nodes offer beyond loading, inside the real ComfyUI (the pack installed and
loaded by ComfyUI's own custom-node loader, workflows run through its validate_prompt and PromptExecutor): a
tooltip on every widget, the loader's trigger words, block-weight presets."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_pack import FLUX_FILE, NODE_IDS

UNET = {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}}
FALCON = "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"  # ss_tag_frequency of a kohya training
REL_TOL = 1e-6  # merged weights against kohya's formula in fp64 (fp32 merge on CPU)
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


def multi_loader(rows: list[tuple[bool, str, float, float]], **inputs) -> dict:
    """LoraWeave Multi Loader on node 1's MODEL with `rows` (on, lora_name, model, clip strength), in the
    API format the frontend sends: the row count, then each row's widgets under `loras.`."""
    values: dict = {"loras": str(len(rows))}
    for i, (on, name, model, clip) in enumerate(rows, 1):
        values |= {f"loras.on_{i}": on, f"loras.lora_{i}": name, f"loras.strength_model_{i}": model,
                   f"loras.strength_clip_{i}": clip}  # fmt: skip
    return {
        "class_type": "LoraWeaveMultiLoader",
        "inputs": {"model": ["1", 0], **values, "mode": "merge", **inputs},
    }


def targeted(patcher) -> dict:
    """The tiny Flux's weights the test files touch, as ComfyUI loads them from `patcher` (its patches
    applied)."""
    from helpers.comfy_sampling import FLUX_TARGETS

    keys = [f"diffusion_model.{t}.weight" for t in (*FLUX_TARGETS, "double_blocks.0.txt_mlp.0")]
    return {k: patcher.patch_weight_to_device(k, return_weight=True) for k in keys}


def run_multi(rows) -> tuple[dict, dict, str, str]:
    """(base weights, weights after the Multi Loader, report, trigger words), through ComfyUI's executor."""
    preview = {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}}
    valid, errors, ex, out = run_prompt({"1": UNET, "2": multi_loader(rows), "3": preview})
    assert valid, errors
    assert ex.success, execution_error(ex)
    model, _, report, triggers = out["2"]
    assert ex.history_result["outputs"]["2"]["text"][0] == report  # shown on the node
    return targeted(out["1"][0]), targeted(model), report, triggers


def stack_prompt(rows: list[tuple[str, float, float]]) -> dict:
    """UNETLoader -> one LoraWeave Stack node per row, chained -> LoraWeave Apply Stack (node 2, merge)."""
    prompt: dict = {"1": UNET}
    for i, (name, model, clip) in enumerate(rows):
        previous = {"lora_stack": [f"s{i - 1}", 0]} if i else {}
        inputs = {"lora_name": name, "model_strength": model, "clip_strength": clip, "enabled": True}
        prompt[f"s{i}"] = {"class_type": "LoraWeaveStack", "inputs": {**inputs, **previous}}
    stack = {"model": ["1", 0], "lora_stack": [f"s{len(rows) - 1}", 0], "stack_mode": "sum"}
    prompt["2"] = {
        "class_type": "LoraWeaveApplyStack",
        "inputs": {**stack, "block_weights": "", "mode": "merge"},
    }
    prompt["3"] = {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}}
    return prompt


def test_multi_loader_equals_the_stack_with_the_rows_that_are_on(comfy_home, both_chains):
    # partial.safetensors holds flux.safetensors' factors (and a key that misses): on, it would change the
    # same layers again
    rows = [(True, "flux.safetensors", 0.7, 0.3), (False, "partial.safetensors", 1.0, 1.0),
            (True, both_chains, -0.4, 1.0), (True, "None", 1.0, 1.0)]  # fmt: skip
    _, weights, report, triggers = run_multi(rows)
    valid, errors, ex, out = run_prompt(
        stack_prompt([("flux.safetensors", 0.7, 0.3), (both_chains, -0.4, 1.0)])
    )
    assert valid and ex.success, errors or execution_error(ex)
    assert same(weights, targeted(out["2"][0]))
    assert report.splitlines()[:4] == [
        "row 1: flux.safetensors (model 0.7, clip 0.3)",
        "row 2: partial.safetensors (model 1, clip 1): off",
        f"row 3: {both_chains} (model -0.4, clip 1)",
        "row 4: no file",
    ]
    assert "keys_applied=30/30" in report, report  # 6 + 24: the off row's 9 keys are not there
    assert triggers == "sks cat, sitting, outdoors"  # flux.safetensors' (both_chains has no metadata)
    switched_on = run_multi([rows[0], (True, *rows[1][1:]), rows[2]])[1]
    assert not same(weights, switched_on), "the row switched on changed nothing"


def test_multi_loader_with_every_row_off_leaves_the_model(comfy_home):
    base, weights, report, triggers = run_multi(
        [(False, "flux.safetensors", 1.0, 1.0), (True, "None", 1.0, 1.0)]
    )
    assert same(weights, base)
    assert report.splitlines()[-1] == "no row is on: nothing applied" and triggers == ""


def test_multi_loader_fingerprint_names_the_files_of_rows_that_are_on(comfy_home):
    """What ComfyUI's own cache asks before re-using the node's output (IsChangedCache over the prompt): the
    identity of each file a row that is on names, so a file rewritten under its name re-runs the node."""
    import execution
    from comfy_execution.graph import DynamicPrompt

    from loraweave.comfy.lora_files import file_fingerprint

    rows = [(True, "flux.safetensors", 1.0, 1.0), (False, "partial.safetensors", 1.0, 1.0)]
    prompt = {"1": UNET, "2": multi_loader(rows)}
    fingerprint = asyncio.run(execution.IsChangedCache("t", DynamicPrompt(prompt), None).get("2"))
    assert fingerprint == [file_fingerprint("flux.safetensors")], fingerprint


# ComfyUI master (../shared/comfyui-latest) in a fresh process: its own custom-node loader takes this clone,
# and its executor runs the Multi Loader (2 rows, the second off) on the tiny Flux
LATEST_MULTI_LOADER = """
import asyncio, json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import helpers.comfy_env as env
env.COMFYUI_DIR = Path(sys.argv[3])
env.import_comfy()
import comfyui_version, execution, folder_paths, nodes
from helpers.comfy_home import _Server
from helpers.comfy_models import flux_state_dict
from helpers.comfy_pack import FLUX_FILE, FLUX_TARGETS, merged_reference, write_loras
from safetensors.torch import load_file, save_file
base = Path(tempfile.mkdtemp(prefix="loraweave-latest-"))
loras = write_loras(base / "loras")
(base / "unet").mkdir()
save_file(flux_state_dict(), base / "unet" / FLUX_FILE)
folder_paths.add_model_folder_path("loras", str(base / "loras"))
folder_paths.add_model_folder_path("diffusion_models", str(base / "unet"))
assert asyncio.run(nodes.load_custom_node(sys.argv[1]))
preview = env.COMFYUI_DIR / "comfy_extras" / "nodes_preview_any.py"
assert asyncio.run(nodes.load_custom_node(str(preview), module_parent="comfy_extras"))
rows = {"loras": "2", "loras.on_1": True, "loras.lora_1": "flux.safetensors", "loras.strength_model_1": 0.7,
        "loras.strength_clip_1": 1.0, "loras.on_2": False, "loras.lora_2": "partial.safetensors",
        "loras.strength_model_2": 1.0, "loras.strength_clip_2": 1.0}
prompt = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}},
          "2": {"class_type": "LoraWeaveMultiLoader", "inputs": {"model": ["1", 0], **rows, "mode": "merge"}},
          "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}}}
valid, _, outputs, errors = asyncio.run(execution.validate_prompt("t", prompt, None))
assert valid, errors
ex = execution.PromptExecutor(_Server(), cache_type=execution.CacheType.CLASSIC,
                              cache_args={"lru": 0, "ram": 0, "ram_inactive": 0})
ex.execute(prompt, "t", {}, outputs)
assert ex.success, ex.status_messages
base_model, model = (asyncio.run(ex.caches.outputs.get(n)).outputs[0][0] for n in ("1", "2"))
tensors = load_file(loras["flux.safetensors"])
error = 0.0
for stem, key in FLUX_TARGETS.items():
    want = merged_reference(base_model.model.state_dict()[key], tensors, stem, 0.7)
    got = model.patch_weight_to_device(key, return_weight=True).double()
    error = max(error, ((got - want).norm() / want.norm()).item())
report = asyncio.run(ex.caches.outputs.get("2")).outputs[2][0]
print(json.dumps({"version": comfyui_version.__version__, "report": report, "error": error}))
"""


def test_multi_loader_runs_in_comfyui_master():
    import os
    import subprocess
    import sys

    from helpers.comfy_env import REPO_ROOT

    latest = REPO_ROOT.parent / "shared" / "comfyui-latest" / "ComfyUI"
    assert (latest / "comfy_api" / "latest" / "_io.py").is_file(), f"missing ComfyUI master at {latest}"
    run = subprocess.run(
        [sys.executable, "-c", LATEST_MULTI_LOADER, str(REPO_ROOT), str(REPO_ROOT / "tests"), str(latest)],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        cwd=REPO_ROOT.parent,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["version"] != "0.19.3", got  # master, not the tree the other tests use
    lines = got["report"].splitlines()
    assert lines[:2] == [
        "row 1: flux.safetensors (model 0.7, clip 1)",
        "row 2: partial.safetensors (model 1, clip 1): off",
    ]
    assert "keys_applied=6/6" in lines[2] and got["error"] < REL_TOL, got
