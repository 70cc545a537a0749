"""A quantized checkpoint whose layout no one can read, on both ComfyUI trees.

- A `comfy_quant` entry naming an unknown format: ComfyUI's own loader refuses the file first
  (`QUANT_ALGOS[format]` in comfy/ops.py: a KeyError naming the format, no model built), so the pack never
  meets such a model from a file.
- A layer already holding a comfy_kitchen QuantizedTensor whose layout comfy_kitchen does not register (what
  a custom node building QuantizedTensors itself can leave; it can neither run nor be dequantized): the pack
  raises QuantizedLayoutError (a TargetError) naming the layer and the field, in every mode, before anything
  is cloned: the MODEL's patches, attachments, weight objects and every stored byte are unchanged. Core's
  LoraLoader fails on the same model and file with a bare KeyError('Float7Layout') from inside its key map
  (`model_lora_keys_unet` reads the model's state_dict, which asks comfy_kitchen for the layout)."""

from __future__ import annotations

import json

import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor
from helpers.comfy_env import import_comfy
from helpers.comfy_files import adapter_file, kohya
from helpers.comfy_quant import flux_sd, load_flux, quantized_linears, same_bytes, storage, write_flux
from safetensors.torch import save_file

from loraweave.comfy import load_lora_for_models
from loraweave.errors import QuantizedLayoutError, TargetError
from loraweave.quant.comfy_kitchen import stored_tensors

pytestmark = [pytest.mark.comfy, pytest.mark.usefixtures("one_thread")]
LAYER = "double_blocks.0.img_attn.qkv"
UNKNOWN = "float7_e3m3"


def test_comfyui_loader_refuses_an_unknown_comfy_quant_format(tmp_path):
    c = import_comfy()
    sd = flux_sd("float8_e4m3fn")
    sd[f"{LAYER}.comfy_quant"] = torch.tensor(
        list(json.dumps({"format": UNKNOWN}).encode()), dtype=torch.uint8
    )
    save_file(sd, str(tmp_path / "unknown.safetensors"))
    with pytest.raises(KeyError, match=UNKNOWN):
        c.sd.load_diffusion_model(str(tmp_path / "unknown.safetensors"), disable_dynamic=True)


@pytest.fixture
def unreadable(tmp_path):
    """A fp8 Flux MODEL whose LAYER holds its own bytes under a layout name comfy_kitchen lacks."""
    patcher = load_flux(write_flux(tmp_path, "float8_e4m3fn"), "float8_e4m3fn")
    layer = patcher.model.diffusion_model.get_submodule(LAYER)
    weight = layer.weight
    data = stored_tensors(weight)["_qdata"]  # the flatten protocol's name for the stored data
    layer.weight = torch.nn.Parameter(QuantizedTensor(data, "Float7Layout", weight.params), False)
    return patcher


@pytest.mark.parametrize("mode", ["auto", "runtime", "merge"])
def test_unregistered_layout_is_a_typed_error_naming_the_layer(unreadable, mode):
    patcher = unreadable
    layers = quantized_linears(patcher)
    sd = adapter_file(layers, "lora", kohya("lora_unet_"))
    before, weights = storage(patcher), {n: m.weight for n, m in layers.items()}
    patches, attachments = dict(patcher.patches), dict(patcher.attachments)
    with pytest.raises(QuantizedLayoutError) as raised:
        load_lora_for_models(patcher, None, sd, 0.8, 0.0, mode=mode)
    assert isinstance(raised.value, TargetError)
    message = str(raised.value)
    assert f"diffusion_model.{LAYER}.weight" in message and "comfy_quant format" in message, message
    assert "'Float7Layout'" in message, message
    assert same_bytes(before, storage(patcher))
    assert all(m.weight is weights[n] for n, m in layers.items())
    assert patcher.patches == patches and patcher.attachments == attachments


def test_core_loraloader_fails_with_a_bare_key_error(unreadable):
    c = import_comfy()
    sd = adapter_file(quantized_linears(unreadable), "lora", kohya("lora_unet_"))
    with pytest.raises(KeyError, match="Float7Layout") as raised:
        c.sd.load_lora_for_models(unreadable, None, sd, 0.8, 0.0)
    assert not isinstance(raised.value, TargetError)
