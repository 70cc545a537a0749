"""The diffusers config of a ComfyUI model's reference tree, from ComfyUI's `unet_config`: the widths and depths a
loaded model really has (a tiny test model, a pruned or distilled release), over the catalog's full-size config.

Only shapes matter (the tree lives on `meta`); an architecture not listed keeps the catalog config, and
`targets.reference_tree` checks the fit against the ComfyUI model's own tensor shapes either way."""

from __future__ import annotations

from collections.abc import Callable


def _unet(cfg: dict) -> dict:
    channels = [cfg["model_channels"] * m for m in cfg["channel_mult"]]
    res_blocks = cfg["num_res_blocks"]
    # transformer_depth lists one entry per input res block; a level's depth is its first block's.
    depths = [cfg["transformer_depth"][sum(res_blocks[:level])] for level in range(len(channels))]
    down = ["CrossAttnDownBlock2D" if d > 0 else "DownBlock2D" for d in depths]
    heads, head_channels = cfg.get("num_heads", -1), cfg.get("num_head_channels", -1)
    head_dim = heads if heads != -1 else tuple(max(1, ch // head_channels) for ch in channels)
    out = {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg["out_channels"],
        "block_out_channels": tuple(channels),
        "layers_per_block": res_blocks[0],
        "down_block_types": tuple(down),
        "up_block_types": tuple(t.replace("Down", "Up") for t in reversed(down)),
        "transformer_layers_per_block": _layers_per_block(depths),
        "cross_attention_dim": cfg["context_dim"],
        "use_linear_projection": bool(cfg.get("use_linear_in_transformer", False)),
        "attention_head_dim": head_dim,
        "norm_num_groups": 32,  # ComfyUI's UNet normalises in 32 groups at every width
    }
    if cfg.get("adm_in_channels"):
        out["projection_class_embeddings_input_dim"] = cfg["adm_in_channels"]
    return out


def _layers_per_block(depths: list[int]) -> int | tuple[int, ...]:
    """diffusers' own spelling (what the shipped skeletons store): one int where every cross-attention level has
    the same depth (levels without attention ignore theirs), else one entry per level."""
    cross = {d for d in depths if d > 0}
    return cross.pop() if len(cross) == 1 else tuple(max(1, d) for d in depths)


def _flux(cfg: dict) -> dict:
    patch = cfg.get("patch_size", 2)
    channels_in, channels_out = cfg["in_channels"] * patch * patch, cfg["out_channels"] * patch * patch
    return {
        "in_channels": channels_in,
        "out_channels": None
        if channels_out == channels_in
        else channels_out,  # diffusers: None is in_channels
        "num_layers": cfg["depth"],
        "num_single_layers": cfg["depth_single_blocks"],
        "attention_head_dim": cfg["hidden_size"] // cfg["num_heads"],
        "num_attention_heads": cfg["num_heads"],
        "joint_attention_dim": cfg["context_in_dim"],
        "pooled_projection_dim": cfg["vec_in_dim"],
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
        "axes_dims_rope": tuple(cfg["axes_dim"]),
    }


def _wan(cfg: dict) -> dict:
    return {
        "patch_size": tuple(cfg["patch_size"]),
        "num_attention_heads": cfg["num_heads"],
        "attention_head_dim": cfg["dim"] // cfg["num_heads"],
        "in_channels": cfg["in_dim"],
        "out_channels": cfg["out_dim"],
        "ffn_dim": cfg["ffn_dim"],
        "num_layers": cfg["num_layers"],
        "freq_dim": cfg["freq_dim"],
        "text_dim": cfg.get("text_dim", 4096),  # ComfyUI always builds a 4096-wide text embedding
    }


def _qwen_image(cfg: dict) -> dict:
    # ComfyUI's detection writes only in_channels and depth; the rest are its model class's defaults.
    return {
        "in_channels": cfg.get("in_channels", 64),
        "out_channels": cfg.get("out_channels") or 16,
        "num_layers": cfg.get("num_layers", 60),
        "attention_head_dim": cfg.get("attention_head_dim", 128),
        "num_attention_heads": cfg.get("num_attention_heads", 24),
        "joint_attention_dim": cfg.get("joint_attention_dim", 3584),
        "axes_dims_rope": tuple(cfg.get("axes_dims_rope", (16, 56, 56))),
    }


def _z_image(cfg: dict) -> dict:
    # ComfyUI's NextDiT keyword names; its detection writes dim, cap_feat_dim and depth, ZImage's class the rest.
    return {
        "dim": cfg["dim"],
        "n_layers": cfg["n_layers"],
        "n_refiner_layers": cfg.get("n_refiner_layers", 2),
        "n_heads": cfg.get("n_heads", 30),
        "n_kv_heads": cfg.get("n_kv_heads", 30),
        "cap_feat_dim": cfg["cap_feat_dim"],
        "in_channels": cfg.get("in_channels", 16),
        "all_patch_size": (cfg.get("patch_size", 2),),
        "axes_dims": list(cfg.get("axes_dims", (32, 48, 48))),
        "axes_lens": list(cfg.get("axes_lens", (1536, 512, 512))),
        "rope_theta": cfg.get("rope_theta", 256.0),
        "qk_norm": bool(cfg.get("qk_norm", True)),
    }


CONFIGS: dict[str, Callable[[dict], dict]] = {
    "sd1": _unet,
    "sd2": _unet,
    "sdxl": _unet,
    "sdxl-refiner": _unet,
    "flux": _flux,
    "flux-schnell": _flux,
    "wan": _wan,
    "qwen-image": _qwen_image,
    "z-image": _z_image,
}


# The config keys that set a block chain's depth (diffusers config key -> chain module paths): a ComfyUI model that
# differs from a shipped skeleton (comfy/skeletons.py) only in these gets that skeleton with its chains cut.
DEPTHS: dict[str, dict[str, tuple[str, ...]]] = {
    "flux": {"num_layers": ("transformer_blocks",), "num_single_layers": ("single_transformer_blocks",)},
    "flux-schnell": {
        "num_layers": ("transformer_blocks",),
        "num_single_layers": ("single_transformer_blocks",),
    },
    "wan": {"num_layers": ("blocks",)},
    "qwen-image": {"num_layers": ("transformer_blocks",)},
    "z-image": {"n_layers": ("layers",), "n_refiner_layers": ("noise_refiner", "context_refiner")},
}


def reference_config(arch: str, unet_config: dict) -> dict:
    """diffusers config entries for `arch` read from ComfyUI's unet_config ({} where the catalog's stand)."""
    convert = CONFIGS.get(arch)
    return convert(unet_config) if convert is not None else {}
