"""Full-size ComfyUI model configs and a meta-device ModelPatcher builder, shared by the real-file and
skeleton tests."""

from __future__ import annotations

import torch

from helpers.comfy_env import import_comfy
from helpers.comfy_models import BASE_UNET_CONFIG, FLUX_PARAMS

META = torch.device("meta")
SD15_UNET = {
    **BASE_UNET_CONFIG,
    "model_channels": 320,
    "channel_mult": [1, 2, 4, 4],
    "num_res_blocks": [2, 2, 2, 2],
    "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0],
    "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0],  # ComfyUI reads it from the last block
    "transformer_depth_middle": 1,
    "context_dim": 768,
    "use_linear_in_transformer": False,
    "adm_in_channels": None,
}
SD2_UNET = {**SD15_UNET, "context_dim": 1024, "use_linear_in_transformer": True}
FLUX_DEV = {**FLUX_PARAMS, "hidden_size": 3072, "num_heads": 24, "depth": 19, "depth_single_blocks": 38,
            "context_in_dim": 4096, "vec_in_dim": 768, "image_model": "flux"}  # fmt: skip


def meta_patcher(config_class, unet_config: dict, dtype: torch.dtype = torch.float16):
    c = import_comfy()
    model_config = config_class(unet_config)
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, "", device=META)
    return c.model_patcher.ModelPatcher(
        model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )
