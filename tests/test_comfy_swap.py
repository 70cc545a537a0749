"""A runtime swap to a file never read, and what it may reuse (loraweave.comfy.targets.Reference: the alias
table and parameter aliases of each reference tree, the spans per set of live shapes; runtime paths built in
one copy).

What is cached per model config and per live shapes is never served to a model it does not describe, and a
file changed at the same path is read again. References: ComfyUI's own LoraLoader merge of the same kohya file
(core lands this layout), on each model; 1e-5 absolute on LATENTs of magnitude ~1, as
tests/test_comfy_runtime.py."""

from __future__ import annotations

import pytest
import torch
from helpers.comfy_sampling import (  # noqa: F401  (pytest fixtures)
    FLUX_TARGETS,
    core_lora,
    flux_fixture,
    kohya_flux_lora,
    nothing_loaded_fixture,
    sample,
    tiny_flux_patcher,
    unload_all,
)
from safetensors.torch import save_file

from loraweave.comfy import targets
from loraweave.comfy.api import read_lora
from loraweave.comfy.runtime import KEY, apply_runtime

pytestmark = pytest.mark.usefixtures("one_thread", "nothing_loaded", "others_unloaded")
ATOL = 1e-5
STEPS = 4
DEEPER_TARGETS = (*FLUX_TARGETS, "double_blocks.1.img_attn.qkv", "double_blocks.1.txt_mlp.0")


@pytest.fixture(scope="module")
def deeper():
    """A Flux of another config (one more double block): another reference tree."""
    return tiny_flux_patcher(seed=4, depth=2)


@pytest.fixture(scope="module")
def twin():
    """A Flux of the same config and shapes as `flux`, with other weights: the same reference and spans."""
    return tiny_flux_patcher(seed=5)


@pytest.fixture
def others_unloaded(deeper, twin):
    unload_all(deeper, twin)
    yield
    unload_all(deeper, twin)


def saved(folder, lora: dict, name: str):
    path = folder / name
    save_file(lora, str(path))
    return path


def runtime(model, lora, strength: float = 0.8):
    out, _, report = apply_runtime(model, None, read_lora(lora), strength, 0.0)
    return out, report


def close(a, b) -> bool:
    return torch.allclose(a["samples"], b["samples"], rtol=0, atol=ATOL)


class Counts:
    """Calls of targets' AliasTable (a reference's alias table) and original_fit (spans onto live shapes)."""

    def __init__(self, monkeypatch) -> None:
        self.tables = self.fits = 0
        table, fits = targets.AliasTable, targets.original_fit

        def counted_table(*args, **kwargs):
            self.tables += 1
            return table(*args, **kwargs)

        def counted_fits(*args, **kwargs):
            self.fits += 1
            return fits(*args, **kwargs)

        monkeypatch.setattr(targets, "AliasTable", counted_table)
        monkeypatch.setattr(targets, "original_fit", counted_fits)


def modules_of(patcher) -> set[int]:
    return {id(m) for m in patcher.model.diffusion_model.modules()}


def check_lands_on(model, patcher, lora: dict, strength: float = 0.8) -> None:
    """Every runtime path sits on a module of `patcher`'s own model, and sampling equals core's merge
    there."""
    state = model.get_attachment(KEY)
    own = modules_of(patcher)
    assert state.paths and all(id(rp.module) in own for rp in state.paths)
    assert close(sample(model, STEPS), sample(core_lora(patcher, lora, strength), STEPS))


def test_a_new_file_on_a_known_model_builds_no_table_and_no_spans(flux, tmp_path, monkeypatch):
    first = saved(tmp_path, kohya_flux_lora(flux, seed=21), "first.safetensors")
    lora = kohya_flux_lora(flux, seed=22)
    new = saved(tmp_path, lora, "new.safetensors")
    runtime(flux, first)
    counts = Counts(monkeypatch)
    model, report = runtime(flux, new)
    assert (counts.tables, counts.fits) == (0, 0), "a swap to a new file rebuilt model-sized state"
    assert report.keys_applied == len(lora)
    check_lands_on(model, flux, lora)
    # the file was read whole once: every pair (whole layers and the fused qkv / linear1 row ranges alike)
    # reads that memory as it is, nothing copied
    source = read_lora(new).source
    paths = model.get_attachment(KEY).paths
    assert len(paths) == len(FLUX_TARGETS) and source.owned
    for rp in paths:
        roles = rp.contributions[0][0].part.roles
        assert rp.down.data_ptr() == source.get(roles["down"]).data_ptr()
        assert rp.up.data_ptr() == source.get(roles["up"]).data_ptr()


def test_a_model_of_another_config_gets_its_own_reference(flux, deeper, tmp_path, monkeypatch):
    runtime(flux, saved(tmp_path, kohya_flux_lora(flux, seed=23), "flux.safetensors"))
    counts = Counts(monkeypatch)
    lora = kohya_flux_lora(deeper, seed=24, targets=DEEPER_TARGETS)
    model, report = runtime(deeper, saved(tmp_path, lora, "deeper.safetensors"))
    assert (counts.tables, counts.fits) == (1, 1), "the deeper model was served the shallower one's reference"
    assert report.keys_applied == len(lora)  # double_blocks.1 exists only in the deeper model's tree
    check_lands_on(model, deeper, lora)
    # ... and the shallow model keeps its own: the deeper file's second block is a miss there, nothing rebuilt
    again, report = runtime(flux, saved(tmp_path, lora, "deeper_on_flux.safetensors"))
    assert (counts.tables, counts.fits) == (1, 1)
    missed = {u.key.split(".")[0] for u in report.unmatched}
    assert missed == {"lora_unet_double_blocks_1_img_attn_qkv", "lora_unet_double_blocks_1_txt_mlp_0"}
    assert all(id(rp.module) in modules_of(flux) for rp in again.get_attachment(KEY).paths)


def test_a_model_of_the_same_shapes_shares_spans_but_lands_on_its_own_modules(
    flux, twin, tmp_path, monkeypatch
):
    lora = kohya_flux_lora(flux, seed=25)
    runtime(flux, saved(tmp_path, lora, "a.safetensors"))
    counts = Counts(monkeypatch)
    model, _ = runtime(twin, saved(tmp_path, kohya_flux_lora(flux, seed=26), "b.safetensors"))
    assert (counts.tables, counts.fits) == (0, 0)
    check_lands_on(model, twin, kohya_flux_lora(flux, seed=26))
    base = sample(flux, STEPS)
    assert not close(base, sample(twin, STEPS)), (
        "the twin must differ from flux for this test to tell them apart"
    )


def test_spans_follow_the_live_shapes(flux):
    """The spans are keyed by the live shapes themselves: a model whose layer has other rows gets no stale
    spans."""
    reference, spans = targets._reference(flux)
    shapes = {k: tuple(v.shape) for k, v in flux.model.diffusion_model.state_dict().items()}
    assert reference.spans_for(dict(shapes)) is spans
    wider = dict(shapes)
    key = "double_blocks.0.img_attn.qkv.weight"
    wider[key] = (shapes[key][0] + 3, shapes[key][1])
    assert reference.spans_for(wider) is None  # widths that do not fit: no reference (fits=no), never `spans`
    assert reference.spans_for(dict(shapes)) is spans


def test_a_file_of_another_size_at_the_same_path_is_read_again(flux, tmp_path):
    """(Same size and mtime:
    tests/test_comfy_runtime.py::test_a_file_rewritten_under_the_same_name_is_read_again.)"""
    path = saved(tmp_path, kohya_flux_lora(flux, seed=27), "same.safetensors")
    runtime(flux, path)
    lora = kohya_flux_lora(flux, seed=28, rank=6)
    saved(tmp_path, lora, "same.safetensors")
    model, _ = runtime(flux, path)
    check_lands_on(model, flux, lora)
