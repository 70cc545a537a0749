"""The LoraWeave node pack inside the real ComfyUI (the tree helpers/comfy_env imports, headless on CPU).

The pack is written by `loraweave comfy install` into a temporary base directory and loaded by ComfyUI's own
custom-node loader; workflows run through ComfyUI's validate_prompt and PromptExecutor (in process, no
server). Merged weights are checked against kohya's formula in fp64 (relative 1e-6; fp32 merge on CPU). Errors
are checked at queue time (validation) or at execution, with the input MODEL left without patches."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.comfy_home import comfy_home_fixture, execution_error, run_prompt  # noqa: F401  (fixture)
from helpers.comfy_pack import FLUX_FILE, FLUX_TARGETS, fake_comfyui, flux_lora, merged_reference
from safetensors.torch import load_file, save_file

from loraweave.cli import main as cli_main
from loraweave.errors import ArgumentError

REL_TOL = 1e-6
CONTRACT = {  # node id -> input names (required and optional) and output types: the public contract
    "LoraWeaveLoader": (
        {
            "model",
            "clip",
            "lora_name",
            "strength_model",
            "strength_clip",
            "mode",
            "strict",
            "allow_other_arch",
            "video_strength",  # optional, last: per-modality strengths (issue 41.4)
            "audio_strength",
            "cross_strength",
        },
        ("MODEL", "CLIP", "STRING", "STRING"),  # report, then trigger_words (appended: slots kept)
    ),
    "LoraWeaveLoaderModelOnly": (
        {
            "model",
            "lora_name",
            "strength_model",
            "mode",
            "strict",
            "allow_other_arch",
            "video_strength",
            "audio_strength",
            "cross_strength",
        },
        ("MODEL", "STRING", "STRING"),
    ),
    "LoraWeaveStack": (
        {"lora_name", "model_strength", "clip_strength", "enabled", "lora_stack"},
        ("LORA_STACK",),
    ),
    "LoraWeaveApplyStack": (
        {
            "model",
            "clip",
            "lora_stack",
            "stack_mode",
            "block_weights",
            "mode",
            "block_preset",
            "allow_other_arch",
        },
        ("MODEL", "CLIP", "STRING"),
    ),
    "LoraWeaveStepWindow": (
        {"model", "lora_name", "strength", "start_percent", "end_percent", "ramp", "allow_other_arch"},
        ("MODEL", "STRING"),
    ),
    "LoraWeaveInspect": ({"lora_name", "model", "clip"}, ("STRING", "STRING", "IMAGE")),
    "LoraWeaveConditioningLoRA": (
        {"conditioning", "lora_name", "strength", "start_percent", "end_percent", "lora_stack"},
        ("CONDITIONING",),
    ),
    "LoraWeaveConditioningTextEncode": (
        {"clip", "text", "lora_name", "strength", "strength_clip", "start_percent", "end_percent"},
        ("CONDITIONING",),
    ),
    "LoraWeaveConditioningRuntime": ({"model", "core_lora_hooks"}, ("MODEL",)),
}


def _graph(node: dict, lora_name: str = "flux.safetensors") -> dict:
    """UNETLoader(tiny Flux) -> node (its model input wired, lora_name set) -> PreviewAny(report)."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}},
        "2": {**node, "inputs": {"model": ["1", 0], "lora_name": lora_name, **node["inputs"]}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", node.get("report_slot", 1)]}},
    }


def _loader(**inputs) -> dict:
    return {
        "class_type": "LoraWeaveLoaderModelOnly",
        "inputs": {"strength_model": 0.7, "mode": "merge", "strict": False, **inputs},
    }


def test_import_loads_no_comfyui():
    code = (
        "import sys, loraweave, loraweave.comfy, loraweave.comfy.extension, loraweave.comfy.install, "
        "loraweave.cli.comfy\nbad = [m for m in sys.modules if m.split('.')[0] in ('comfy', 'comfy_api', "
        "'folder_paths', 'nodes')]\nassert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def test_schemas_are_the_public_contract(comfy_home):
    import nodes

    for node_id, (inputs, outputs) in CONTRACT.items():
        cls = nodes.NODE_CLASS_MAPPINGS[node_id]
        declared = cls.INPUT_TYPES()
        assert set(declared["required"]) | set(declared.get("optional", {})) == inputs, node_id
        assert tuple(cls.RETURN_TYPES) == outputs, node_id
        assert nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id].startswith("LoraWeave")
    loader = nodes.NODE_CLASS_MAPPINGS["LoraWeaveLoader"].INPUT_TYPES()
    # old workflows run without the opt-in and the modality strengths
    modalities = {"video_strength", "audio_strength", "cross_strength"}
    assert set(loader["optional"]) == {"clip", "allow_other_arch", *modalities}
    cond_lora = nodes.NODE_CLASS_MAPPINGS["LoraWeaveConditioningLoRA"].INPUT_TYPES()
    assert set(cond_lora["optional"]) == {"lora_stack"}  # old workflows load without it
    assert "flux.safetensors" in loader["required"]["lora_name"][1]["options"]
    assert loader["required"]["mode"][1]["options"] == ["auto", "merge", "runtime"]
    web = nodes.EXTENSION_WEB_DIRS["loraweave_nodes"]
    assert (Path(web) / "loraweave.js").is_file()


def test_loader_merges_kohya_formula_and_leaves_input(comfy_home):
    valid, errors, ex, out = run_prompt(_graph(_loader()))
    assert valid and ex.success, errors or execution_error(ex)
    base, patched = out["1"][0], out["2"][0]
    tensors = load_file(comfy_home["loras"]["flux.safetensors"])
    for stem, key in FLUX_TARGETS.items():
        want = merged_reference(base.model.state_dict()[key], tensors, stem, 0.7)
        got = patched.patch_weight_to_device(key, return_weight=True).double()
        assert ((got - want).norm() / want.norm()).item() < REL_TOL, key
    assert base.patches == {}, "the input MODEL got patches"
    report = ex.history_result["outputs"]["2"]["text"][0]
    assert report == out["2"][1] and "keys_applied=6/6" in report
    assert (
        ex.history_result["outputs"]["3"]["text"][0] == report
    )  # the STRING wires into core Preview as Text


def test_loader_with_clip_patches_both(comfy_home):
    import nodes
    from helpers.comfy_models import tiny_flux

    tiny = tiny_flux()
    te_stem = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    te_key = "clip_l.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
    g = torch.Generator().manual_seed(3)
    tensors = {
        **flux_lora(),
        f"{te_stem}.lora_down.weight": torch.randn(4, 32, generator=g) * 0.1,
        f"{te_stem}.lora_up.weight": torch.randn(32, 4, generator=g) * 0.1,
        f"{te_stem}.alpha": torch.tensor(2.0),
    }
    path = comfy_home["base"] / "models" / "loras" / "with_te.safetensors"
    save_file(tensors, path)
    cls = nodes.NODE_CLASS_MAPPINGS["LoraWeaveLoader"]
    result = cls.execute(
        model=tiny.patcher,
        clip=tiny.clip,
        lora_name=path.name,
        strength_model=1.0,
        strength_clip=0.5,
        mode="merge",
        strict=False,
    )
    model, clip, report, _ = result.args
    te_base = tiny.clip.cond_stage_model.state_dict()[te_key]
    want = merged_reference(te_base, tensors, te_stem, 0.5)
    got = clip.patcher.patch_weight_to_device(te_key, return_weight=True).double()
    assert ((got - want).norm() / want.norm()).item() < REL_TOL
    assert tiny.clip.patcher.patches == {} and tiny.patcher.patches == {}
    assert "keys_applied=9/9" in report and result.ui.as_dict()["text"] == (report,)


def test_partial_file_warns_with_counts(comfy_home, caplog):
    with caplog.at_level(logging.WARNING, logger="loraweave"):
        valid, errors, ex, out = run_prompt(_graph(_loader(), "partial.safetensors"))
    assert valid and ex.success, errors or execution_error(ex)
    first = out["2"][1].splitlines()[0]
    assert first == "WARNING: partial.safetensors: 6 of 9 keys landed"
    assert "keys_applied=6 keys_total=9" in caplog.text


@pytest.mark.parametrize(
    "name, says",
    [
        ("missing.safetensors", "no such file in ComfyUI's loras folders"),
        ("../models/loras/flux.safetensors", "refused"),
        ("/etc/passwd", "refused"),
        ("broken.safetensors", "broken.safetensors"),
    ],
)
def test_bad_names_refused_at_queue_time(comfy_home, name, says):
    valid, errors, _, _ = run_prompt(_graph(_loader(), name))
    assert not valid
    details = errors["2"]["errors"][0]["details"]
    assert details.startswith("lora_name") and says in details and name.rsplit("/")[-1] in details


@pytest.mark.parametrize(
    "name, strict, error",
    [
        ("sd1.safetensors", False, "NoKeysLandedError"),
        ("sd1.safetensors", True, "Error"),  # strict may refuse first: either error names the file
        ("partial.safetensors", True, "StrictApplyError"),
    ],
)
def test_execution_errors_name_the_file_and_leave_input(comfy_home, name, strict, error):
    valid, _, ex, out = run_prompt(_graph(_loader(strict=strict), name))
    assert valid and not ex.success
    failure = execution_error(ex)
    assert failure["node_id"] == "2" and failure["exception_type"].startswith("loraweave.errors.")
    assert failure["exception_type"].endswith(error)
    assert name in failure["exception_message"]
    assert out["1"][0].patches == {}


def test_stack_rows_chain_and_apply_like_the_loader(comfy_home):
    import nodes

    row = nodes.NODE_CLASS_MAPPINGS["LoraWeaveStack"]
    first = row.execute("flux.safetensors", 0.7, 0.3, True).args[0]
    off = row.execute("partial.safetensors", 1.0, 1.0, False, lora_stack=first).args[0]
    none = row.execute("None", 1.0, 1.0, True, lora_stack=off).args[0]
    assert first == [("flux.safetensors", 0.7, 0.3)] and none == first and none is not first
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}},
        "4": {
            "class_type": "LoraWeaveStack",
            "inputs": {
                "lora_name": "flux.safetensors",
                "model_strength": 0.7,
                "clip_strength": 0.3,
                "enabled": True,
            },
        },
        "2": {
            "class_type": "LoraWeaveApplyStack",
            "inputs": {
                "model": ["1", 0],
                "lora_stack": ["4", 0],
                "stack_mode": "sum",
                "block_weights": "",
                "mode": "merge",
            },
        },
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 2]}},
    }
    valid, errors, ex, out = run_prompt(prompt)
    assert valid and ex.success, errors or execution_error(ex)
    _, _, _, single = run_prompt(_graph(_loader()))
    for key in FLUX_TARGETS.values():
        stacked = out["2"][0].patch_weight_to_device(key, return_weight=True)
        loaded = single["2"][0].patch_weight_to_device(key, return_weight=True)
        assert torch.allclose(stacked, loaded, rtol=REL_TOL, atol=0), key
    assert out["1"][0].patches == {}


@pytest.mark.parametrize(
    "stack, says",
    [
        ("flux.safetensors", "lora_stack: expected a list"),
        ([("flux.safetensors", 1.0)], "lora_stack[0]"),
        ([("flux.safetensors", 1.0, 1.0), (3, 1.0, 1.0)], "lora_stack[1]"),
        ([("../flux.safetensors", 1.0, 1.0)], "refused"),
        ([("flux.safetensors", float("nan"), 1.0)], "lora_stack[0] model_strength"),
        (
            [("flux.safetensors", 1.0, 1.0), ("flux.safetensors", 1.0, float("inf"))],
            "lora_stack[1] clip_strength",
        ),
    ],
)
def test_foreign_stack_rows_checked(comfy_home, stack, says):
    import nodes

    apply = nodes.NODE_CLASS_MAPPINGS["LoraWeaveApplyStack"]
    with pytest.raises(ArgumentError, match=re.escape(says)):
        apply.execute(model=None, lora_stack=stack, stack_mode="sum", block_weights="", mode="auto")


def test_step_window_checks_its_range(comfy_home):
    window = {"class_type": "LoraWeaveStepWindow", "inputs": {"strength": 1.0, "ramp": 0.0}}
    backwards = _graph({**window, "inputs": {**window["inputs"], "start_percent": 0.8, "end_percent": 0.2}})
    valid, errors, _, _ = run_prompt(backwards)
    assert not valid and "start_percent 0.8 is after end_percent 0.2" in errors["2"]["errors"][0]["details"]
    valid, errors, ex, out = run_prompt(
        _graph({**window, "inputs": {**window["inputs"], "start_percent": 0.2, "end_percent": 0.6}})
    )
    assert valid and ex.success, errors or execution_error(ex)
    assert out["2"][0] is not out["1"][0] and out["1"][0].patches == {}
    assert "active from 0.2 to 0.6 of the steps" in out["2"][1]


def test_inspect_outputs_report_triggers_and_the_cli_heatmap(comfy_home, tmp_path):
    from PIL import Image

    prompt = {"2": {"class_type": "LoraWeaveInspect", "inputs": {"lora_name": "flux.safetensors"}}}
    valid, errors, ex, out = run_prompt(prompt)
    assert valid and ex.success, errors or execution_error(ex)
    report, triggers, image = out["2"]
    assert triggers == "sks cat, sitting, outdoors"  # 12, 3+4, 5: most frequent first
    assert "kohya" in report and ex.history_result["outputs"]["2"]["text"][0] == report
    png = tmp_path / "heatmap.png"
    assert cli_main(["inspect", str(comfy_home["loras"]["flux.safetensors"]), "--plot", str(png)]) == 0
    want = np.asarray(Image.open(png).convert("RGB"), dtype=np.float32) / 255.0
    assert image.dtype == torch.float32 and image.shape == (1, *want.shape)
    assert torch.equal(image[0], torch.from_numpy(want))


def _coverage(report: str) -> str:
    return next(line for line in report.splitlines() if line.startswith("coverage"))


@pytest.mark.parametrize(
    ("lora_name", "alone", "landed"),
    [
        ("flux.safetensors", "0/6", "6/6"),
        ("partial.safetensors", "0/9", "6/9"),
        ("sd1.safetensors", "3/3", "0/3"),
    ],
)
def test_inspect_judges_against_a_connected_model(comfy_home, lora_name, alone, landed):
    # The tiny Flux (hidden 128) is what a pruned or distilled release looks like to the catalog: unconnected,
    # Inspect judges the file on the full-size model of its architecture (Flux.1, 3072 wide: nothing lands;
    # the SD1 file lands on SD1.5); connected, it judges on the model's own modules with the loader's
    # resolver.
    import nodes

    unwired = {"2": {"class_type": "LoraWeaveInspect", "inputs": {"lora_name": lora_name}}}
    valid, errors, ex, out = run_prompt(unwired)
    assert valid and ex.success, errors or execution_error(ex)
    assert _coverage(out["2"][0]).split()[1] == alone, out["2"][0]  # today's behaviour, unchanged
    assert "connected MODEL" not in out["2"][0]
    wired = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": FLUX_FILE, "weight_dtype": "default"}},
        "2": {"class_type": "LoraWeaveInspect", "inputs": {"lora_name": lora_name, "model": ["1", 0]}},
    }
    valid, errors, ex, out = run_prompt(wired)
    assert valid and ex.success, errors or execution_error(ex)
    report = out["2"][0]
    line = _coverage(report)
    assert line.split()[1] == landed and "on the connected MODEL (flux, its own modules)" in line, report
    assert ("  unmatched" in report) == (landed != "6/6"), report  # each miss named by kind
    assert out["1"][0].patches == {}  # nothing patched on the MODEL it judged
    if landed.startswith("0/"):
        return  # the loader refuses a file of which no key lands (test_execution_errors_name_the_file...)
    loader = nodes.NODE_CLASS_MAPPINGS["LoraWeaveLoaderModelOnly"]  # one resolver: the loader's count
    text = loader.execute(out["1"][0], lora_name, 1.0, "merge", False).args[1]
    assert f"keys_applied={landed}" in text, text


def test_install_uninstall_round_trip(tmp_path, capsys):
    root = fake_comfyui(tmp_path / "ComfyUI")
    assert cli_main(["comfy", "install", str(root), "--json"]) == 0
    written = json.loads(capsys.readouterr().out)
    shim = root / "custom_nodes" / "loraweave_nodes"
    assert written["shim"] == str(shim) and sorted(p.name for p in shim.iterdir()) == sorted(written["files"])
    assert cli_main(["comfy", "install", str(root)]) == 0  # again over our own install
    assert capsys.readouterr().out.startswith(f"installed {shim}")
    (shim / "__pycache__").mkdir()
    (shim / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"")
    (shim / "notes.txt").write_text("the user's")
    assert cli_main(["comfy", "uninstall", str(root), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["left"] == ["notes.txt"] and sorted(p.name for p in shim.iterdir()) == ["notes.txt"]
    (shim / "notes.txt").unlink()
    shim.rmdir()
    assert sorted(p.name for p in (root / "custom_nodes").iterdir()) == []


def test_install_refusals(tmp_path, capsys):
    not_comfy = tmp_path / "plain"
    not_comfy.mkdir()
    assert cli_main(["comfy", "install", str(not_comfy)]) == 2
    assert f"{not_comfy}: not a ComfyUI folder (no main.py" in capsys.readouterr().err
    root = fake_comfyui(tmp_path / "ComfyUI")
    assert cli_main(["comfy", "uninstall", str(root)]) == 2  # nothing of ours there
    foreign = root / "custom_nodes" / "loraweave_nodes"
    foreign.mkdir()
    assert cli_main(["comfy", "install", str(root)]) == 2
    assert "was not written by loraweave" in capsys.readouterr().err
    foreign.rmdir()
    assert cli_main(["comfy", "install", str(root)]) == 0
    (foreign / "__init__.py").write_text("# edited by hand\n")
    assert cli_main(["comfy", "uninstall", str(root)]) == 2
    assert "changed since loraweave installed it" in capsys.readouterr().err
    assert (foreign / "__init__.py").read_text() == "# edited by hand\n"


def test_yaml_entry_points_at_the_shipped_shim(tmp_path, capsys):
    root = fake_comfyui(tmp_path / "ComfyUI")
    assert cli_main(["comfy", "install", str(root), "--yaml"]) == 0
    entry = capsys.readouterr().out
    folder = Path(entry.split("custom_nodes:", 1)[1].strip())
    assert entry.startswith("loraweave:\n") and (folder / "loraweave_nodes" / "__init__.py").is_file()
    assert sorted(p.name for p in (root / "custom_nodes").iterdir()) == []  # nothing written
