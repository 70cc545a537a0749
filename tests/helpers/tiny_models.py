"""Tiny seeded models of the real diffusers architectures, with a forward runner each."""

from __future__ import annotations

import torch


def tiny_flux(seed: int = 0):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 6, 6],
        guidance_embeds=True,
    ).eval()


def flux_forward(model, seed: int = 1, device: str = "cpu", **extra):
    g = torch.Generator().manual_seed(seed)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g),
        encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g),
        timestep=torch.tensor([0.5]),
        guidance=torch.tensor([3.5]),
        img_ids=torch.zeros(16, 3),
        txt_ids=torch.zeros(5, 3),
    )
    return model(**{k: v.to(device) for k, v in inputs.items()}, return_dict=False, **extra)[0]


def tiny_zimage(seed: int = 0):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(seed)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=64,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,
        axes_dims=[8, 12, 12],
        axes_lens=[64, 32, 32],
    ).eval()


def zimage_forward(model, seed: int = 1, **extra):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(4, 1, 8, 8, generator=g)]
    cap = [torch.randn(7, 32, generator=g)]
    return model(x, torch.tensor([0.5]), cap, return_dict=False, **extra)[0][0]


def tiny_sdxl_unet(seed: int = 0):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=2,
        block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2),
        attention_head_dim=(2, 4),
        cross_attention_dim=32,
        norm_num_groups=8,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=32 + 6 * 8,
    ).eval()


def unet_forward(model, seed: int = 1, **extra):
    g = torch.Generator().manual_seed(seed)
    added = {"text_embeds": torch.randn(1, 32, generator=g), "time_ids": torch.randn(1, 6, generator=g)}
    return model(
        torch.randn(1, 4, 16, 16, generator=g),
        torch.tensor([10]),
        torch.randn(1, 5, 32, generator=g),
        added_cond_kwargs=added,
        return_dict=False,
        **extra,
    )[0]


MODELS = {
    "flux": (tiny_flux, flux_forward, "transformer"),
    "zimage": (tiny_zimage, zimage_forward, "transformer"),
    "sdxl_unet": (tiny_sdxl_unet, unet_forward, "unet"),
}
