"""A ComfyUI Flux.1-dev MODEL at its released size on the meta device, its layers materialized one at a time.

The model is built the way ComfyUI loads a checkpoint: a BFL-named state dict (here meta tensors at the
Flux.1-dev shapes: hidden 3072, 24 heads, 19 double and 38 single blocks, T5 context 4096, CLIP vector 768)
goes through ComfyUI's own `model_detection.model_config_from_unet`, which must answer `supported_models.Flux`
with those numbers; `get_model(..., device="meta")` then builds ComfyUI's own Flux with its own ops, and a
`ModelPatcher` holds it. No weight has storage until `comfy_layer` gives one layer seeded bf16 values
(helpers/realsize.py's generator, so bits are regenerated instead of copied)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .comfy_env import import_comfy
from .comfy_models import FLUX_PARAMS, _bfl_name
from .realsize import fill_seeded

# Flux.1-dev as ComfyUI's detection reads it from the released file (the tiny twin's other numbers are the
# same).
FLUX_DEV = {
    **FLUX_PARAMS,
    "vec_in_dim": 768,
    "context_in_dim": 4096,
    "hidden_size": 3072,
    "num_heads": 24,
    "depth": 19,
    "depth_single_blocks": 38,
}


def meta_flux_patcher(dtype: torch.dtype = torch.bfloat16, detected_as: str = "Flux", **params):
    """A `ModelPatcher` over ComfyUI's Flux.1-dev at full size, every weight on the meta device. `params`
    override FLUX_DEV, and ComfyUI's detection must answer `detected_as` (Flux Fill: in_channels=96,
    out_channels=16, i.e. 384 inputs after the 2x2 patchify -> supported_models.FluxInpaint)."""
    c = import_comfy()
    import comfy.ldm.flux.model
    import comfy.ops

    want = {**FLUX_DEV, **params}
    with torch.device("meta"):
        shapes = comfy.ldm.flux.model.Flux(operations=comfy.ops.disable_weight_init, **want).state_dict()
    bfl = {_bfl_name(k): v for k, v in shapes.items()}
    config = c.model_detection.model_config_from_unet(bfl, "")
    assert type(config).__name__ == detected_as, f"ComfyUI detected {type(config).__name__}"
    detected = {k: config.unet_config.get(k) for k in want}
    assert detected == want, f"ComfyUI detects {detected}"
    config.set_inference_dtype(dtype, None)
    model = config.get_model(bfl, "", device=torch.device("meta"))
    cpu = torch.device("cpu")
    return c.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


@contextmanager
def comfy_layer(patcher, module: str, seed: int) -> Iterator[torch.Tensor]:
    """The weight of ComfyUI module `module` (e.g. `single_blocks.0.linear1`) with storage and seeded values
    in the model's dtype (its bias too); back on meta afterwards."""
    layer = patcher.model.diffusion_model.get_submodule(module)
    try:
        layer.to_empty(device="cpu", recurse=False)
        fill_seeded(layer.weight, seed)
        if layer.bias is not None:
            fill_seeded(layer.bias, seed + 1000)
        yield layer.weight
    finally:
        layer.to("meta")
