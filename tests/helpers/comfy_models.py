"""Tiny ComfyUI models built the way ComfyUI loads them, each with its diffusers twin and a CLIP.

- Flux (hidden 128, 1 double + 1 single block): a BFL-layout state dict through `comfy.sd.
  load_diffusion_model_state_dict` (what UNETLoader runs: ComfyUI's own detection picks
  `supported_models.Flux`).
- SD1.5 and SDXL: small UNets are not detected by `model_config_from_unet` (SD15 needs 320/768), so the config
  comes from `comfy.model_detection.detect_unet_config` on the LDM state dict and goes into
  `supported_models.SD15` / `SDXL` directly (notes §2.7 (b)).

The weights start in a seeded diffusers model (`ComfyModel.diffusers`); SD UNets reach LDM names through
ComfyUI's own `comfy.utils.unet_to_diffusers` map, Flux through diffusers' single-file converter run backwards
is not available, so Flux starts from the BFL state dict and the twin is built with diffusers'
`convert_flux_transformer_checkpoint_to_diffusers`. CLIPs are `comfy.sd.CLIP` objects of ComfyUI's own text
encoder classes, shrunk through their `<name>_model_config` model options."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .comfy_env import import_comfy

# Text encoders shrunk through ComfyUI's `<model_name>_model_config` override (the vocab stays: the tokenizers
# are real).
CLIP_L_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 3,
    "projection_dim": 32,
}
CLIP_G_SMALL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 3,
    "projection_dim": 32,
}
T5_SMALL = {"d_model": 32, "d_ff": 64, "d_kv": 16, "num_heads": 2, "num_layers": 2}
CLIP_OPTIONS = {
    "clip_l_model_config": CLIP_L_SMALL,
    "clip_g_model_config": CLIP_G_SMALL,
    "t5xxl_model_config": T5_SMALL,
}


@dataclass
class ComfyModel:
    """A ComfyUI MODEL (ModelPatcher) and CLIP, the diffusers twin holding the same weights, and its name."""

    name: str
    patcher: object  # comfy.model_patcher.ModelPatcher
    clip: object  # comfy.sd.CLIP
    diffusers: torch.nn.Module


def _seeded(module: torch.nn.Module, seed: int) -> None:
    # ComfyUI's ops skip init (torch.empty); every parameter gets seeded values at a trained-weight scale.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def tiny_clip(kind: str, seed: int = 7):
    """comfy.sd.CLIP of ComfyUI's own classes: "sd1" (clip_l), "sdxl" (clip_l + clip_g), "flux" (clip_l +
    t5xxl)."""
    c = import_comfy()
    import comfy.sd1_clip
    import comfy.sdxl_clip
    import comfy.supported_models_base
    import comfy.text_encoders.flux

    targets = {
        "sd1": (comfy.sd1_clip.SD1Tokenizer, comfy.sd1_clip.SD1ClipModel),
        "sdxl": (comfy.sdxl_clip.SDXLTokenizer, comfy.sdxl_clip.SDXLClipModel),
        "flux": (comfy.text_encoders.flux.FluxTokenizer, comfy.text_encoders.flux.flux_clip()),
    }
    tokenizer, model = targets[kind]
    target = comfy.supported_models_base.ClipTarget(tokenizer, model)
    clip = c.sd.CLIP(target, model_options={**CLIP_OPTIONS, "dtype": torch.float32}, disable_dynamic=True)
    _seeded(clip.cond_stage_model, seed)
    return clip


def _sd_unet_diffusers(kind: str, seed: int):
    from diffusers import UNet2DConditionModel

    common = dict(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        cross_attention_dim=32,
        norm_num_groups=32,
    )
    if kind == "sd15":
        config = dict(
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=8,
        )
    else:  # SDXL: linear projections, text_time embedding (ComfyUI's SDXL embeds 6 time ids at 256 each)
        config = dict(
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2),
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=32 + 6 * 256,
        )
    model = UNet2DConditionModel(**common, **config).eval()
    _seeded(model, seed)
    return model


# The ComfyUI UNet configs of the twins above, as detect_unet_config writes them (the helper checks they
# match).
SD_UNET_CONFIGS = {
    "sd15": {
        "transformer_depth": [1, 0],
        "transformer_depth_output": [1, 1, 0, 0],
        "transformer_depth_middle": 1,
        "use_linear_in_transformer": False,
        "adm_in_channels": None,
    },
    "sdxl": {
        "transformer_depth": [0, 2],
        "transformer_depth_output": [0, 0, 2, 2],
        "transformer_depth_middle": 2,
        "use_linear_in_transformer": True,
        "adm_in_channels": 32 + 6 * 256,
        "num_classes": "sequential",
    },
}
BASE_UNET_CONFIG = {
    "model_channels": 32,
    "channel_mult": [1, 2],
    "num_res_blocks": [1, 1],
    "context_dim": 32,
    "use_checkpoint": False,
    "image_size": 32,
    "use_spatial_transformer": True,
    "legacy": False,
    "in_channels": 4,
    "out_channels": 4,
    "use_temporal_resblock": False,
    "use_temporal_attention": False,
}


def tiny_sd_unet(kind: str = "sd15", seed: int = 0) -> ComfyModel:
    """SD1.5 ("sd15") or SDXL ("sdxl") at 32/64 channels as a ComfyUI ModelPatcher with its CLIP."""
    c = import_comfy()
    twin = _sd_unet_diffusers(kind, seed)
    config = {**BASE_UNET_CONFIG, **SD_UNET_CONFIGS[kind]}
    to_diffusers = c.utils.unet_to_diffusers(config)
    twin_sd = twin.state_dict()
    ldm = {ldm_key: twin_sd[d_key].clone() for d_key, ldm_key in to_diffusers.items() if d_key in twin_sd}
    assert len(ldm) == len(twin_sd), f"{kind}: {len(twin_sd) - len(ldm)} diffusers keys have no LDM name"
    detected = c.model_detection.detect_unet_config(ldm, "")
    assert {k: detected.get(k) for k in config} == config, f"{kind}: ComfyUI detects {detected}"
    model_config = (c.supported_models.SD15 if kind == "sd15" else c.supported_models.SDXL)(detected)
    if kind == "sdxl":  # 64 channels per head would leave the tiny levels headless; the twin uses 16
        model_config.unet_config["num_head_channels"] = 16
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "")
    model.load_model_weights(ldm, "")
    patcher = c.model_patcher.ModelPatcher(
        model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )
    return ComfyModel(kind, patcher, tiny_clip("sd1" if kind == "sd15" else "sdxl"), twin)


FLUX_PARAMS = {
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 32,
    "context_in_dim": 32,
    "hidden_size": 128,
    "mlp_ratio": 4.0,
    "num_heads": 1,
    "depth": 1,
    "depth_single_blocks": 1,
    "axes_dim": [16, 56, 56],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "guidance_embed": True,
    "txt_ids_dims": [],
}


def flux_state_dict(seed: int = 0, **params) -> dict[str, torch.Tensor]:
    """A BFL-layout Flux.1-dev state dict at hidden 128 (the shapes of ComfyUI's own Flux class), seeded;
    `params` override FLUX_PARAMS (a deeper model: depth=2)."""
    import_comfy()
    import comfy.ldm.flux.model
    import comfy.ops

    with torch.device("meta"):
        shapes = comfy.ldm.flux.model.Flux(
            operations=comfy.ops.disable_weight_init, **{**FLUX_PARAMS, **params}
        ).state_dict()
    g = torch.Generator().manual_seed(seed)
    # BFL files name the q/k RMSNorm weights `.scale`; ComfyUI's Flux.process_unet_state_dict renames them.
    return {_bfl_name(k): torch.randn(v.shape, generator=g) * 0.05 for k, v in shapes.items()}


def _bfl_name(key: str) -> str:
    return key[: -len(".weight")] + ".scale" if key.endswith("_norm.weight") else key


def tiny_flux(seed: int = 0) -> ComfyModel:
    """Flux.1-dev at hidden 128 loaded as UNETLoader does (ComfyUI's detection), with a CLIP-L + T5 CLIP."""
    c = import_comfy()

    bfl = flux_state_dict(seed)
    patcher = c.sd.load_diffusion_model_state_dict(
        dict(bfl), model_options={"dtype": torch.float32}, disable_dynamic=True
    )
    assert patcher is not None and type(patcher.model.model_config).__name__ == "Flux", (
        "ComfyUI did not detect Flux"
    )
    return ComfyModel("flux", patcher, tiny_clip("flux"), flux_twin(patcher))


def flux_twin(patcher, in_channels: int = 64, out_channels: int | None = None):
    """The diffusers FluxTransformer2DModel holding the hidden-128 ComfyUI Flux's weights (flux_rows_map);
    `in_channels` after patchify (Fill: 384)."""
    from diffusers import FluxTransformer2DModel

    twin = FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        out_channels=out_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=128,
        num_attention_heads=1,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ).eval()
    comfy_sd = patcher.model.diffusion_model.state_dict()
    names = twin.state_dict()
    twin.load_state_dict(
        {name: rows_of(comfy_sd, where) for name, where in flux_rows_map(patcher).items() if name in names}
    )
    return twin


def flux_rows_map(patcher) -> dict:
    """diffusers name -> ComfyUI name, (name, (dim, start, length)) or (name, offset, fn): ComfyUI's own
    `comfy.utils.flux_to_diffusers` (what its loader of diffusers-format Flux files uses). diffusers'
    single-file converter hard-codes inner_dim 3072, so it cannot map a 128-wide model."""
    c = import_comfy()
    return c.utils.flux_to_diffusers(patcher.model.model_config.unet_config, output_prefix="")


def rows_of(state: dict[str, torch.Tensor], where) -> torch.Tensor:
    """The rows `where` (a flux_rows_map value) names in a ComfyUI state dict."""
    if isinstance(where, str):
        return state[where]
    tensor = state[where[0]]
    if where[1] is not None:
        tensor = tensor.narrow(*where[1])
    return where[2](tensor) if len(where) > 2 else tensor


WAN_PARAMS = {
    "dim": 128,
    "ffn_dim": 256,
    "num_layers": 2,
    "num_heads": 1,
    "text_dim": 4096,
    "in_dim": 4,
    "out_dim": 4,
    "freq_dim": 256,
    "model_type": "t2v",
}


def tiny_wan(seed: int = 0) -> ComfyModel:
    """Wan 2.1 T2V at dim 128 (ComfyUI reads heads as dim // 128) loaded as UNETLoader does, its diffusers
    twin through diffusers' convert_wan_transformer_to_diffusers; the CLIP is the SD1 one (only shapes matter
    here)."""
    c = import_comfy()
    import comfy.ldm.wan.model
    import comfy.ops
    from diffusers import WanTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    with torch.device("meta"):
        shapes = comfy.ldm.wan.model.WanModel(
            operations=comfy.ops.disable_weight_init, **WAN_PARAMS
        ).state_dict()
    g = torch.Generator().manual_seed(seed)
    original = {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in shapes.items()}
    patcher = c.sd.load_diffusion_model_state_dict(
        dict(original), model_options={"dtype": torch.float32}, disable_dynamic=True
    )
    assert patcher is not None and type(patcher.model.model_config).__name__ == "WAN21_T2V", (
        "ComfyUI did not detect Wan"
    )
    twin = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=1,
        attention_head_dim=128,
        in_channels=4,
        out_channels=4,
        text_dim=4096,  # ComfyUI's Wan detection reads no text width: it builds 4096
        freq_dim=256,
        ffn_dim=256,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
    ).eval()
    twin.load_state_dict(convert_wan_transformer_to_diffusers({k: v.clone() for k, v in original.items()}))
    return ComfyModel("wan", patcher, tiny_clip("sd1"), twin)


BUILDERS = {
    "sd15": lambda: tiny_sd_unet("sd15"),
    "sdxl": lambda: tiny_sd_unet("sdxl"),
    "flux": tiny_flux,
    "wan": tiny_wan,
}


def _detected(c, original: dict[str, torch.Tensor], expect: str, widths: dict, chosen=None):
    """ComfyUI's own detection of `original` (model_detection), with the widths its detection does not read
    from the file set in unet_config (they go to the model class as keyword arguments, as ComfyUI's defaults
    would), then the model built and loaded as load_diffusion_model_state_dict does. `chosen`: the
    supported_models class for a tiny model that detection matches by a full-size width (notes §2.7 (b)),
    given the detected config."""
    if chosen is None:
        model_config = c.model_detection.model_config_from_unet(original, "")
    else:
        model_config = chosen(c.model_detection.detect_unet_config(original, ""))
    assert model_config is not None and type(model_config).__name__ == expect, (
        f"ComfyUI did not detect {expect}"
    )
    model_config.unet_config.update(widths)
    model_config.set_inference_dtype(torch.float32, None)
    model = model_config.get_model({}, "")
    model.load_model_weights(original, "")
    return c.model_patcher.ModelPatcher(
        model, load_device=torch.device("cpu"), offload_device=torch.device("cpu")
    )


def _seeded_shapes(shapes: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.05 for k, v in shapes.items()}


# ComfyUI's Qwen-Image detection reads only in_channels and the depth: the widths below are unet_config
# entries.
QWEN_WIDTHS = {
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "joint_attention_dim": 32,
    "axes_dims_rope": (8, 12, 12),
}


def tiny_qwen_image(seed: int = 0) -> ComfyModel:
    """Qwen-Image at inner width 64, 2 blocks. ComfyUI keeps the diffusers names for Qwen-Image (and diffusers
    has no single-file converter for it), so the twin loads ComfyUI's state dict as it is: the identity row
    map."""
    c = import_comfy()
    import comfy.ldm.qwen_image.model
    import comfy.ops
    from diffusers import QwenImageTransformer2DModel

    with torch.device("meta"):
        shapes = comfy.ldm.qwen_image.model.QwenImageTransformer2DModel(
            in_channels=64,
            out_channels=16,
            num_layers=2,
            operations=comfy.ops.disable_weight_init,
            **QWEN_WIDTHS,
        ).state_dict()
    original = _seeded_shapes(shapes, seed)
    patcher = _detected(c, dict(original), "QwenImage", QWEN_WIDTHS)
    twin = QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, **QWEN_WIDTHS
    ).eval()
    twin.load_state_dict(original)
    return ComfyModel("qwen-image", patcher, tiny_clip("sd1"), twin)


# Z-Image: detection reads dim, cap_feat_dim and depth, and picks ZImage only at dim 3840; the rest are
# unet_config. dim 1024 is the least at which diffusers' timestep MLP (hidden fixed at 1024) has ComfyUI's
# min(dim, 1024) width; multiple_of 1 keeps ComfyUI's SwiGLU width at diffusers' int(dim / 3 * 8) (at 3840
# both give 10240).
Z_IMAGE_DIM = 1024
Z_IMAGE_WIDTHS = {
    "n_heads": 8,
    "n_kv_heads": 8,
    "axes_dims": [32, 48, 48],
    "axes_lens": [64, 32, 32],
    "rope_theta": 256.0,
    "ffn_dim_multiplier": 8.0 / 3.0,
    "multiple_of": 1,
    "z_image_modulation": True,
    "time_scale": 1000.0,
    "pad_tokens_multiple": 32,
}


def z_image_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """An original-layout (NextDiT) Z-Image state dict at dim 1024, 1 layer (+ 2 + 2 refiners), seeded."""
    import_comfy()
    import comfy.ldm.lumina.model
    import comfy.ops

    with torch.device("meta"):
        shapes = comfy.ldm.lumina.model.NextDiT(
            patch_size=2,
            in_channels=16,
            dim=Z_IMAGE_DIM,
            n_layers=1,
            cap_feat_dim=32,
            qk_norm=True,
            operations=comfy.ops.disable_weight_init,
            **Z_IMAGE_WIDTHS,
        ).state_dict()
    return _seeded_shapes(shapes, seed)


def tiny_z_image(seed: int = 0) -> ComfyModel:
    """Z-Image at dim 1024 as ComfyUI's supported_models.ZImage on the detected config; the twin through
    diffusers' convert_z_image_transformer_checkpoint_to_diffusers (fused qkv split in three)."""
    c = import_comfy()
    from diffusers import ZImageTransformer2DModel
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    original = z_image_state_dict(seed)
    patcher = _detected(c, dict(original), "ZImage", Z_IMAGE_WIDTHS, c.supported_models.ZImage)
    twin = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=16,
        dim=Z_IMAGE_DIM,
        n_layers=1,
        n_refiner_layers=2,
        n_heads=8,
        n_kv_heads=8,
        cap_feat_dim=32,
        rope_theta=256.0,
        axes_dims=[32, 48, 48],
        axes_lens=[64, 32, 32],
    ).eval()
    converted = convert_z_image_transformer_checkpoint_to_diffusers(
        {k: v.clone() for k, v in original.items()}
    )
    twin.load_state_dict(converted)
    return ComfyModel("z-image", patcher, tiny_clip("sd1"), twin)
