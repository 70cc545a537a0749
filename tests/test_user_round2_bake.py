"""Issue 30, a new user's second run-through: baking real files into checkpoints (items 3 and 13)."""

from __future__ import annotations

import pytest
import torch
from conftest import REALDATA
from helpers.common import real_config
from helpers.sparse_checkpoint import sparse_checkpoint, sparse_module_file

import loraweave
from loraweave.arch.unet_original import unet_original_names
from loraweave.tools.bake import merged_weight
from loraweave.tools.bake_plan import plan_adapters, tensor_plan
from loraweave.tools.checkpoint import open_checkpoint
from loraweave.tools.convert import convert
from loraweave.tools.inspect import inspect_adapter

CLONEOFSIMO = REALDATA / "lora" / "cloneofsimo__lora__analog_svd_rank4.safetensors"
DIFFUSERS_SD1 = REALDATA / "lora" / "timohavdk__sd-lora__2100-lora.safetensors"
UNET, TEXT = "model.diffusion_model.", "cond_stage_model.transformer."


@pytest.fixture(scope="module")
def sd15_ldm(realdata, tmp_path_factory):
    """SD1.5 in original (ldm) names at full size: real names and shapes (sd-mecha's key list), no data."""
    out = tmp_path_factory.mktemp("ldm") / "sd15-ldm.safetensors"
    return sparse_checkpoint(realdata / "keys" / "sd-mecha" / "sd1-ldm.yaml", out)


def _reference_targets() -> set[str]:
    """The ldm tensors the file's parts merge into, from the live diffusers UNet and CLIP text model built
    from the real SD1.5 configs (positions counted on the real classes), renamed by the ldm <-> diffusers
    map."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(real_config("sd15__unet_config.json"))
        text = CLIPTextModel(CLIPTextConfig(**real_config("sd15__text_encoder_config.json")))
    report = loraweave.plan({"unet": unet, "text_encoder": text}, CLONEOFSIMO)
    assert report.keys_applied == report.keys_total == 384
    to_ldm = {live: original for original, live in unet_original_names(unet).items()}
    names = set()
    for m in report.applied:
        if m.component == "unet":
            names.add(f"{UNET}{to_ldm[m.module]}.weight")
        else:
            names.add(
                f"{TEXT}{m.module if m.module.startswith('text_model.') else 'text_model.' + m.module}.weight"
            )
    return names


def test_cloneofsimo_text_encoder_lands_on_an_ldm_named_checkpoint(sd15_ldm):
    """bake named the positional parts on a skeleton whose CLIP tree lacks `text_model.`, and the ldm file's
    shadow tree has it: 288/384 landed. inspect --model counted positions in a tree with no CLIP classes."""
    ckpt = open_checkpoint(sd15_ldm)
    try:
        plan, spans = plan_adapters(ckpt, [(str(CLONEOFSIMO), 1.0)])
        work = tensor_plan(ckpt, plan, spans)
    finally:
        ckpt.close()
    assert plan.unmatched == []
    assert set(work) == _reference_targets()
    assert sum(name.startswith(TEXT) for name in work) == 48  # 12 layers x q, k, v, out

    info = inspect_adapter(CLONEOFSIMO, model=str(sd15_ldm))
    assert (info["coverage"]["keys_applied"], info["coverage"]["keys_total"]) == (384, 384)


def _merged(model, adapter) -> tuple[dict[str, torch.Tensor], list]:
    """{tensor: what bake writes into it, on a zero base}, and what did not land: bake's own plan and
    merge."""
    ckpt = open_checkpoint(model)
    try:
        plan, spans = plan_adapters(ckpt, [(str(adapter), 1.0)])
        work = tensor_plan(ckpt, plan, spans)
        shapes = {name: ckpt.source(ckpt.files[0]).shape(name) for name in work}
    finally:
        ckpt.close()
    zeros = {name: torch.zeros(shapes[name][0], *shapes[name][1:]) for name in work}
    return {
        name: merged_weight(zeros[name], contribs, torch.float32) for name, (_, contribs) in work.items()
    }, [u.miss.kind for u in plan.unmatched]


def test_comfy_named_file_bakes_into_a_diffusers_named_unet(realdata, tmp_path):
    """A bare diffusers-named UNet file (no config beside it) gave a shadow tree with no class, so our own
    `convert --to comfy` output (ldm names) landed 0 keys there, though inspect lands it. It bakes the same
    tensors, bit for bit, as the diffusers-named file it was converted from."""
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(real_config("sd15__unet_config.json"))
    model = sparse_module_file(unet, tmp_path / "unet" / "sd15-unet.safetensors")
    comfy = tmp_path / "comfy.safetensors"
    convert(DIFFUSERS_SD1, "comfy", comfy, arch="sd1")

    reference, missed = _merged(model, DIFFUSERS_SD1)
    assert missed == [] and len(reference) == 128
    baked, missed = _merged(model, comfy)
    assert missed == [] and baked.keys() == reference.keys()
    assert all(torch.equal(baked[name], reference[name]) for name in reference)
