"""Depth-expanded models (issue 41.3): an Anima 28-block LoRA on the 40-block Anima-2.9B lands by the
inserted positions, exactly (fp64 against the independent formula W + B·A on the model's block), and any depth
pair whose positions are not declared is refused with both depths named, the model unchanged.

Sources of the key lists and positions: the Anima-2.9B expand_manifest.json's inserted blocks as quoted in
Haoming02/sd-webui-forge-classic #1401 ({2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36}); the converter of
AUTOMATIC1111/stable-diffusion-webui-extensions #437 (0->0, 2->3, 14->20, 27->39; `lora_unet_blocks_*`,
`diffusion_model.blocks.*` key families); sd-webui-forge-classic #1453 (kohya keys
`lora_unet_blocks_0_cross_attn_k_proj.lora_down.weight`; pre-remapped 40-layout files skipping the inserted
blocks; depth from the highest block index snapped to 28 / 40 / 52); #1431 (52-block Anima-3.8B, whose
positions have no published manifest). Depths are the real ones (28, 40, 52 blocks); widths are tiny, the
block chain being what is under test.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.arch_layouts import anima_original
from helpers.tiny_configs import ANIMA_DIT_TINY
from safetensors.torch import save_file

import loraweave
from loraweave.errors import AdapterMetadataError, DepthMismatchError

# Typed out from the sources above, not read from the arch record.
INSERTED_40 = {2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36}
KEPT_40 = [j for j in range(40) if j not in INSERTED_40]
# the converter's own spot checks (A1111 extensions #437)
SPOT = {0: 0, 2: 3, 14: 20, 27: 39}
BLOCK_LINEARS = ("self_attn.q_proj", "cross_attn.k_proj", "mlp.layer2")


def _model(depth: int) -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    return diffusers.CosmosTransformer3DModel(**{**ANIMA_DIT_TINY, "num_layers": depth}).double().eval()


def _live(name: str) -> str:
    return {
        "self_attn.q_proj": "attn1.to_q",
        "cross_attn.k_proj": "attn2.to_k",
        "mlp.layer2": "ff.net.2",
    }[name]


def _file(model, blocks, spelling: str = "comfy", seed: int = 3) -> dict[str, torch.Tensor]:
    """A LoRA on BLOCK_LINEARS of each of `blocks`, in ComfyUI (diffusion_model.blocks.N.x) or kohya
    (lora_unet_blocks_N_x) names, fp64."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in blocks:
        for name in BLOCK_LINEARS:
            out, inp = model.get_submodule(f"transformer_blocks.0.{_live(name)}").weight.shape
            down = torch.randn(2, inp, generator=g, dtype=torch.float64)
            up = torch.randn(out, 2, generator=g, dtype=torch.float64) * 0.1
            if spelling == "comfy":
                stem = f"diffusion_model.{anima_original(f'blocks.{i}.{name}')}"
                sd[f"{stem}.lora_A.weight"], sd[f"{stem}.lora_B.weight"] = down, up
            else:
                stem = f"lora_unet_blocks_{i}_{name.replace('.', '_')}"
                sd[f"{stem}.lora_down.weight"], sd[f"{stem}.lora_up.weight"] = down, up
    return sd


def _factors(sd: dict, i: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    comfy = f"diffusion_model.blocks.{i}.{name}"
    if f"{comfy}.lora_A.weight" in sd:
        return sd[f"{comfy}.lora_B.weight"], sd[f"{comfy}.lora_A.weight"]
    kohya = f"lora_unet_blocks_{i}_{name.replace('.', '_')}"
    return sd[f"{kohya}.lora_up.weight"], sd[f"{kohya}.lora_down.weight"]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _unchanged(model, before) -> bool:
    after = model.state_dict()
    return all(torch.equal(after[k], v) for k, v in before.items())


def _assert_landed(model, before, sd, where: dict[int, int]) -> None:
    """Block i of the file changed exactly block where[i] of the model; every other weight unchanged."""
    expected = dict(before)
    for i, j in where.items():
        for name in BLOCK_LINEARS:
            up, down = _factors(sd, i, name)
            key = f"transformer_blocks.{j}.{_live(name)}.weight"
            expected[key] = before[key] + up @ down
    after = model.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(after[key], value, rtol=1e-13, atol=1e-14, msg=key)


@pytest.mark.parametrize("spelling", ["comfy", "kohya"])
def test_28_block_file_lands_by_the_inserted_positions_on_40(spelling):
    model = _model(40)
    before = _weights(model)
    sd = _file(_model(1), range(28), spelling)
    handle = loraweave.apply(model, sd, mode="merge", strict=True)
    assert all(KEPT_40[i] == j for i, j in SPOT.items())
    _assert_landed(model, before, sd, dict(enumerate(KEPT_40)))
    after = model.state_dict()
    for j in INSERTED_40:  # the new blocks were never trained by this file
        for name in BLOCK_LINEARS:
            key = f"transformer_blocks.{j}.{_live(name)}.weight"
            assert torch.equal(after[key], before[key])
    notes = {n for row in handle.report.applied for n in row.notes}
    assert any(n.startswith("block 14 -> 20 (28-block file on a 40-block model") for n in notes)
    handle.remove()
    assert _unchanged(model, before)


def test_partial_28_block_file_is_snapped_up_to_28():
    """A file training blocks 0..9 only: highest index 9, snapped up to the 28 released (forge #1453)."""
    model = _model(40)
    before = _weights(model)
    sd = _file(_model(1), range(10))
    loraweave.apply(model, sd, mode="merge", strict=True)
    _assert_landed(model, before, sd, {i: KEPT_40[i] for i in range(10)})


def test_pre_remapped_40_layout_file_is_not_mapped_twice():
    """forge #1452/#1453: a file already in the 40-block layout (inserted blocks skipped) lands as it is."""
    model = _model(40)
    before = _weights(model)
    sd = _file(_model(1), KEPT_40)
    loraweave.apply(model, sd, mode="merge", strict=True)
    _assert_landed(model, before, sd, {j: j for j in KEPT_40})


def test_metadata_depth_overrides_the_highest_index(tmp_path):
    """A 40-block file that trained blocks 0..9 only says so in ss_network_args (AnimaLoraStudio #503)."""
    model = _model(40)
    before = _weights(model)
    sd = _file(_model(1), range(10))
    path = tmp_path / "anima29.safetensors"
    save_file(sd, str(path), metadata={"ss_network_args": json.dumps({"base_num_blocks": 40})})
    loraweave.apply(model, str(path), mode="merge", strict=True)
    _assert_landed(model, before, sd, {i: i for i in range(10)})


@pytest.mark.parametrize(("file_depth", "model_depth"), [(28, 52), (40, 52), (40, 28)])
def test_unknown_positions_refuse_naming_both_depths(file_depth, model_depth):
    model = _model(model_depth)
    before = _weights(model)
    sd = _file(_model(1), range(file_depth))
    with pytest.raises(DepthMismatchError) as err:
        loraweave.apply(model, sd, mode="merge")
    assert (err.value.file_depth, err.value.model_depth) == (file_depth, model_depth)
    assert f"trained on {file_depth} blocks" in str(err.value)
    assert f"the model has {model_depth}" in str(err.value)
    assert _unchanged(model, before)


def test_metadata_depth_contradicting_the_keys_is_refused(tmp_path):
    model = _model(40)
    path = tmp_path / "bad.safetensors"
    save_file(_file(_model(1), range(40)), str(path), metadata={"ss_network_args": '{"base_num_blocks": 28}'})
    with pytest.raises(DepthMismatchError, match="trained on 28 blocks \\(metadata"):
        loraweave.apply(model, str(path), mode="merge")


@pytest.mark.parametrize("value", ["2.5", "-3", '"many"', "1e999"])
def test_hostile_depth_metadata_names_the_field(tmp_path, value):
    model = _model(40)
    before = _weights(model)
    path = tmp_path / "hostile.safetensors"
    save_file(
        _file(_model(1), range(28)),
        str(path),
        metadata={"ss_network_args": f'{{"base_num_blocks": {value}}}'},
    )
    with pytest.raises(AdapterMetadataError, match="base_num_blocks"):
        loraweave.apply(model, str(path), mode="merge")
    assert _unchanged(model, before)


def test_same_depth_and_other_depth_families_are_left_alone():
    """A 28-block file on a 28-block model lands as it is (no note); a 36-block Cosmos-Predict2 14B depth is
    not one of Anima's, so its files are never re-mapped."""
    model = _model(28)
    before = _weights(model)
    sd = _file(_model(1), range(28))
    handle = loraweave.apply(model, sd, mode="merge", strict=True)
    _assert_landed(model, before, sd, {i: i for i in range(28)})
    assert not any(row.notes for row in handle.report.applied)
    model36 = _model(36)
    before36 = _weights(model36)
    loraweave.apply(model36, _file(_model(1), range(20)), mode="merge", strict=True)
    _assert_landed(model36, before36, _file(_model(1), range(20)), {i: i for i in range(20)})
