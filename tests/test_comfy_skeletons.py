"""The reference skeletons shipped with the ComfyUI pack (loraweave.comfy.skeletons, written by
scripts/comfy_skeletons.py) against diffusers itself: every module path, class name, parameter and buffer
shape and dtype equal to the diffusers model built from the same config, at the stored depth and with block
chains cut or grown; and real files plan onto full-width ComfyUI models exactly as on diffusers' own tree,
without importing diffusers' model classes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.comfy_env import REPO_ROOT, import_comfy
from helpers.comfy_full import FLUX_DEV, SD2_UNET, SD15_UNET, meta_patcher

from loraweave.arch.catalog import CATALOG
from loraweave.comfy import targets
from loraweave.comfy.reference import facets
from loraweave.comfy.skeletons import description, packaged_tree, rebuild, record
from loraweave.comfy.targets import COMFY_ARCHS, plan_for_patcher
from loraweave.formats.adapter import load_adapter
from loraweave.tools.skeleton import describe

ARCHS = sorted(a for a in set(COMFY_ARCHS.values()) if a in CATALOG)
DEPTH_ARCHS = sorted(a for a in ARCHS if facets(a).depths)  # flux, flux-schnell, qwen-image, wan, z-image


def shape_of(module: torch.nn.Module) -> tuple[list, dict]:
    """Everything the planner can read: (path, class, own parameters) in named_modules order, and every
    state-dict entry's shape and dtype (persistent buffers included)."""
    state = {k: (tuple(v.shape), v.dtype) for k, v in module.state_dict().items()}
    return describe(module)["modules"], state


def diffusers_tree(cls: str, config: dict) -> torch.nn.Module:
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, cls).from_config(config)


def test_every_mapped_architecture_ships_its_diffusers_skeleton():
    """Each shipped file is what scripts/comfy_skeletons.py writes from the installed diffusers (a stale or
    edited file fails), for the current catalog config, and rebuilds to diffusers' tree module for module."""
    for arch in ARCHS:
        assert facets(arch).skeleton == arch, arch  # the file scripts/comfy_skeletons.py writes for it
        data, fresh = description(arch), record(arch)
        assert fresh is not None, f"{arch}: diffusers lacks {CATALOG[arch].cls}"
        assert data == fresh, f"{arch}: the shipped skeleton is stale (run scripts/comfy_skeletons.py)"
        ref = diffusers_tree(data["cls"], data["config"])
        rebuilt = rebuild(data)
        assert shape_of(rebuilt) == shape_of(ref) and type(rebuilt).__name__ == type(ref).__name__, arch


@pytest.mark.parametrize("arch", DEPTH_ARCHS)
def test_block_chains_cut_and_grown_as_diffusers_builds_them(arch):
    entry = CATALOG[arch]
    for key in facets(arch).depths:
        for depth in (0, 1, 3, description(arch)["config"][key] + 1):
            config = {**entry.config, key: depth}
            tree = packaged_tree(arch, entry.cls, config)
            assert tree is not None, (arch, key, depth)
            assert shape_of(tree) == shape_of(diffusers_tree(entry.cls, config)), (arch, key, depth)
            assert getattr(tree.config, key) == depth


@pytest.mark.parametrize("arch", ["flux", "flux-schnell"])
@pytest.mark.parametrize(
    "widths",
    [
        {"in_channels": 384, "out_channels": 64},  # Flux Fill
        {"in_channels": 128, "out_channels": 64},  # Canny / Depth control
        {"in_channels": 128},  # out_channels None: proj_out follows in_channels, as diffusers reads it
        {"out_channels": 32},
        {"in_channels": 384, "out_channels": 64, "num_layers": 2},  # with a depth change
    ],
)
def test_widened_inputs_resized_as_diffusers_builds_them(arch, widths):
    entry = CATALOG[arch]
    config = {**entry.config, **widths}
    tree = packaged_tree(arch, entry.cls, config)
    assert tree is not None, widths
    assert shape_of(tree) == shape_of(diffusers_tree(entry.cls, config)), widths


def test_other_configs_are_not_served():
    entry = CATALOG["flux"]
    assert packaged_tree("flux", entry.cls, dict(entry.config)) is not None
    assert packaged_tree("flux", entry.cls, {**entry.config, "num_attention_heads": 2}) is None  # width
    assert packaged_tree("flux", entry.cls, {**entry.config, "not_a_key": 1}) is None
    assert packaged_tree("flux", entry.cls, {**entry.config, "num_layers": -1}) is None
    assert packaged_tree("flux", entry.cls, {**entry.config, "num_layers": True}) is None
    assert packaged_tree("flux", "FluxTransformer2DModelX", dict(entry.config)) is None  # another class
    assert packaged_tree("sd1", CATALOG["sd1"].cls, {**CATALOG["sd1"].config, "layers_per_block": 1}) is None
    assert packaged_tree("not-an-arch", entry.cls, dict(entry.config)) is None
    for bad in (0, -64, True, 384.0, "384"):
        assert packaged_tree("flux", entry.cls, {**entry.config, "in_channels": bad}) is None, bad


def plan_rows(plan) -> tuple[list, list, list]:
    planned = sorted(
        (pp.part.keys, pp.component, pp.pieces, pp.part.family, pp.scale, pp.strength) for pp in plan.planned
    )
    params = sorted((p.part.keys, p.owner, p.name) for p in plan.params)
    return planned, params, sorted((u.key, u.kind) for u in plan.unmatched)


FLUX_FILE = "leighwoods__public-loras__lora.safetensors"  # single blocks 7..20
FULL_WIDTH = {  # label: (ComfyUI model class, unet_config, real file)
    "sd1": ("SD15", SD15_UNET, "timohavdk__sd-lora__2100-lora.safetensors"),
    "sd2": ("SD20", SD2_UNET, "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"),
    "flux": ("Flux", FLUX_DEV, FLUX_FILE),
    "flux-cut": (
        "Flux",
        {**FLUX_DEV, "depth": 2, "depth_single_blocks": 21},
        FLUX_FILE,
    ),  # the benchmark's kind
}


def test_full_width_comfy_models_plan_as_on_diffusers_tree(realdata, monkeypatch, caplog):
    """ComfyUI's own full-width SD1.5, SD2, Flux.1-dev and a cut Flux (its unet_config through reference.py)
    get the shipped skeleton, and real files plan onto it exactly as onto diffusers' tree of the same
    config."""
    c = import_comfy()
    for label, (model_class, unet_config, name) in FULL_WIDTH.items():
        model = meta_patcher(getattr(c.supported_models, model_class), unet_config)
        adapter = load_adapter(realdata / "lora" / name)
        targets._meta_tree.cache_clear()
        with caplog.at_level("INFO", logger="loraweave"):
            packaged = plan_for_patcher(model, adapter)
        assert "source=package" in caplog.text, f"{label}: the shipped skeleton did not serve"
        caplog.clear()
        with monkeypatch.context() as m:
            m.setattr(targets, "packaged_tree", lambda *a: None)
            targets._meta_tree.cache_clear()
            with caplog.at_level("INFO", logger="loraweave"):
                reference = plan_for_patcher(model, adapter)
            assert "source=diffusers" in caplog.text
        caplog.clear()
        assert packaged.planned and not packaged.unmatched, label
        assert plan_rows(packaged) == plan_rows(reference), label
    targets._meta_tree.cache_clear()


@pytest.mark.parametrize(
    ("arch", "model_class"),
    [("sd1", "SD15"), ("sd2", "SD20"), ("sdxl", "SDXL"), ("sdxl-refiner", "SDXLRefiner")],
)
def test_unet_configs_comfy_detects_get_the_shipped_skeleton(arch, model_class, caplog):
    """ComfyUI's own detection of each released UNet (from the catalog model's keys) gives a unet_config that
    reference.py turns into the shipped skeleton's config: the tree is served without diffusers and fits."""
    c = import_comfy()
    entry = CATALOG[arch]
    unet_config = c.model_detection.unet_config_from_diffusers_unet(
        diffusers_tree(entry.cls, entry.config).state_dict()
    )
    model = meta_patcher(getattr(c.supported_models, model_class), unet_config)
    targets._meta_tree.cache_clear()
    with caplog.at_level("INFO", logger="loraweave"):
        found = targets.reference_tree(model)
    targets._meta_tree.cache_clear()
    assert "source=package" in caplog.text and found is not None and found[1]


def test_a_queue_on_a_full_width_model_imports_no_diffusers_model_class(realdata):
    """In a fresh process (ComfyUI imported as the tests do, which imports diffusers' lazy top level):
    planning a real file on Flux.1-dev imports none of diffusers' model modules, nor peft."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT / "tests")!r})
        from test_comfy_realdata import FLUX_DEV, meta_patcher
        from helpers.comfy_env import import_comfy
        from loraweave.comfy.targets import plan_for_patcher
        from loraweave.formats.adapter import load_adapter
        model = meta_patcher(import_comfy().supported_models.Flux, FLUX_DEV)
        before = set(sys.modules)
        lora = {str(realdata / "lora" / "leighwoods__public-loras__lora.safetensors")!r}
        plan = plan_for_patcher(model, load_adapter(lora))
        assert plan.planned and not plan.unmatched
        watched = ("diffusers.models", "peft", "torchao")
        new = sorted(m for m in set(sys.modules) - before if m.startswith(watched))
        print("NEW", new)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "NEW []" in run.stdout, run.stdout[-2000:]
