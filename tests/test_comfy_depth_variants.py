"""Depth variants in the ComfyUI pack (issue 41.3), both trees: an Anima 28-block LoRA in ComfyUI's names on
ComfyUI's own 40-block Anima lands by the blocks Anima-2.9B inserted (fp64 formula W + s·γ·up@down on
ComfyUI's tensors, the inserted blocks untouched); on a 52-block model it is refused naming both depths,
nothing cloned. Inserted blocks typed out from Anima-2.9B's expand_manifest.json as quoted in
Haoming02/sd-webui-forge-classic #1401; depths are the real ones, widths tiny (helpers.comfy_dits2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.comfy_checks import comfy_modules, merged_state, rel
from helpers.comfy_dits import _load, _meta_state
from helpers.comfy_dits2 import COSMOS_PARAMS, COSMOS_WIDTHS, _small_llm_adapter
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, dotted
from helpers.comfy_models import _seeded_shapes

from loraweave.comfy import load_lora_for_models
from loraweave.errors import DepthMismatchError

INSERTED_40 = {2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36}
KEPT_40 = [j for j in range(40) if j not in INSERTED_40]
LINEARS = ("self_attn.q_proj", "cross_attn.k_proj", "mlp.layer2")
STRENGTH = 0.7


def _anima(depth: int) -> SimpleNamespace:
    """ComfyUI's own Anima at `depth` blocks (detected and loaded by ComfyUI from a seeded state dict), at
    narrow widths: the block chain is what is under test."""
    c = import_comfy()
    import comfy.ldm.anima.model as anima

    params = {**COSMOS_PARAMS, "image_model": "anima", "num_blocks": depth, "model_channels": 32}
    with _small_llm_adapter():
        state = _seeded_shapes(_meta_state(anima.Anima, **params), 0)
        patcher, _ = _load(c, dict(state), "Anima", {**COSMOS_WIDTHS, "num_blocks": depth})
    return SimpleNamespace(patcher=patcher)


def _file(m) -> dict[str, torch.Tensor]:
    """A 28-block file: block i's linears named as ComfyUI names them (the model's block 0 gives shapes)."""
    mods = comfy_modules(m)
    linears = {f"blocks.{i}.{n}": mods.get_submodule(f"blocks.0.{n}") for i in range(28) for n in LINEARS}
    return adapter_file(linears, "lora", dotted("diffusion_model."))


def test_28_block_file_on_comfy_40_block_anima_lands_by_the_inserted_blocks():
    m = _anima(40)
    sd = _file(m)
    model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
    assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    merged, base = merged_state(model), comfy_modules(m).state_dict()
    moved = dict(enumerate(KEPT_40))
    for i, j in moved.items():
        for n in LINEARS:
            stem = f"diffusion_model.blocks.{i}.{n}"
            up, down = sd[f"{stem}.lora_up.weight"].double(), sd[f"{stem}.lora_down.weight"].double()
            gamma = sd[f"{stem}.alpha"].item() / down.shape[0]
            ref = base[f"blocks.{j}.{n}.weight"].double() + STRENGTH * gamma * (up @ down)
            assert rel(merged[f"blocks.{j}.{n}.weight"], ref) <= 1e-6, (i, j, n)
    for j in INSERTED_40:
        for n in LINEARS:
            assert torch.equal(merged[f"blocks.{j}.{n}.weight"], base[f"blocks.{j}.{n}.weight"])
    notes = {r.module: r.notes for r in report.applied}
    assert any(x.startswith("block 14 -> 20 ") for x in notes["blocks.20.self_attn.q_proj"])


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_28_block_file_on_comfy_52_block_anima_is_refused(mode):
    m = _anima(52)
    before = {k: v.clone() for k, v in comfy_modules(m).state_dict().items()}
    with pytest.raises(DepthMismatchError, match="trained on 28 blocks .*the model has 52"):
        load_lora_for_models(m.patcher, None, _file(m), 1.0, 0.0, mode=mode)
    assert not m.patcher.patches
    assert all(torch.equal(v, before[k]) for k, v in comfy_modules(m).state_dict().items())
