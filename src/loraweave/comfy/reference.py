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


def _double_single(cfg: dict, patched: bool = True) -> dict:
    """The entries every BFL-style double/single-block model shares (Flux.1, Flux.2, Chroma); `patched`: ComfyUI
    counts channels before patching (Chroma counts them after, as diffusers does)."""
    patch = cfg.get("patch_size", 1) if patched else 1
    return {
        "in_channels": cfg["in_channels"] * patch * patch,
        "out_channels": cfg["out_channels"] * patch * patch,
        "num_layers": cfg["depth"],
        "num_single_layers": cfg["depth_single_blocks"],
        "attention_head_dim": cfg["hidden_size"] // cfg["num_heads"],
        "num_attention_heads": cfg["num_heads"],
        "joint_attention_dim": cfg["context_in_dim"],
        "axes_dims_rope": tuple(cfg["axes_dim"]),
    }


def _flux(cfg: dict) -> dict:
    out = {
        **_double_single({"patch_size": 2, **cfg}),
        "pooled_projection_dim": cfg["vec_in_dim"],
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }
    if out["out_channels"] == out["in_channels"]:
        out["out_channels"] = (
            None  # diffusers' own spelling (None is in_channels), as the shipped skeleton stores it
        )
    return out


def _flux2(cfg: dict) -> dict:
    return {
        **_double_single(cfg),
        "mlp_ratio": cfg.get("mlp_ratio", 3.0),
        "rope_theta": cfg.get("theta", 2000),
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }


def _chroma(cfg: dict) -> dict:
    return {
        **_double_single(cfg, patched=False),
        "approximator_num_channels": cfg.get("in_dim", 64),
        "approximator_hidden_dim": cfg.get("hidden_dim", 5120),
        "approximator_layers": cfg.get("n_layers", 5),
    }


def _hunyuan_base(cfg: dict) -> dict:
    """What ComfyUI's HunyuanVideo class (HunyuanVideo, 1.5, HunyuanImage 2.1) sets alike: heads of 128 (its
    detection), a token refiner always 2 blocks deep."""
    return {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg["out_channels"],
        "num_attention_heads": cfg["num_heads"],
        "attention_head_dim": cfg["hidden_size"] // cfg["num_heads"],
        "num_layers": cfg["depth"],
        "num_refiner_layers": 2,
        "mlp_ratio": cfg.get("mlp_ratio", 4.0),
        "text_embed_dim": cfg["context_in_dim"],
        "rope_axes_dim": tuple(cfg["axes_dim"]),
        "rope_theta": float(cfg.get("theta", 256)),
    }


def _video_patch(cfg: dict, default: tuple[int, ...]) -> dict:
    patch = list(cfg.get("patch_size", default))
    return {"patch_size": patch[-1], "patch_size_t": patch[0] if len(patch) == 3 else 1}


def _hunyuan_video(cfg: dict) -> dict:
    return {
        **_hunyuan_base(cfg),
        **_video_patch(cfg, (1, 2, 2)),
        "num_single_layers": cfg["depth_single_blocks"],
        "pooled_projection_dim": cfg.get("vec_in_dim") or 768,
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }


def _hunyuan_15_21(cfg: dict) -> dict:
    # ComfyUI's glyph mapper (`byt5_in`) always reads 1472-wide ByT5 states.
    return {
        **_hunyuan_base(cfg),
        "qk_norm": "rms_norm",
        "text_embed_2_dim": 1472 if cfg.get("byt5") else None,
        "use_meanflow": bool(cfg.get("meanflow", False)),
    }


def _hunyuan_video_15(cfg: dict) -> dict:
    return {
        **_hunyuan_15_21(cfg),
        **_video_patch(cfg, (1, 1, 1)),
        "image_embed_dim": cfg.get("vision_in_dim") or 1152,
    }


def _hunyuan_image_21(cfg: dict) -> dict:
    return {
        **_hunyuan_15_21(cfg),
        "patch_size": tuple(cfg.get("patch_size", (1, 1))),
        "num_single_layers": cfg["depth_single_blocks"],
        "guidance_embeds": bool(cfg.get("guidance_embed", False)),
    }


def _kandinsky5(cfg: dict) -> dict:
    # ComfyUI's Kandinsky5 keyword defaults for what its detection does not write. Its visual embedding reads
    # `visual_embed_dim` inputs; diffusers reads in_visual_dim (x2 + 1 mask channel with visual_cond) per patch.
    patch = tuple(cfg.get("patch_size", (1, 2, 2)))
    in_visual = cfg.get("in_visual_dim", 16)
    per_patch = cfg.get("visual_embed_dim", 132) // (patch[0] * patch[1] * patch[2])
    return {
        "in_visual_dim": in_visual if per_patch == in_visual else (per_patch - 1) // 2,
        "visual_cond": per_patch != in_visual,
        "out_visual_dim": cfg.get("out_visual_dim", 16),
        "in_text_dim": cfg.get("in_text_dim", 3584),
        "in_text_dim2": cfg.get("in_text_dim2", 768),
        "time_dim": cfg.get("time_dim", 512),
        "patch_size": patch,
        "model_dim": cfg.get("model_dim", 1792),
        "ff_dim": cfg.get("ff_dim", 7168),
        "num_text_blocks": cfg.get("num_text_blocks", 2),
        "num_visual_blocks": cfg.get("num_visual_blocks", 32),
        "axes_dims": tuple(cfg.get("axes_dims", (16, 24, 24))),
    }


# ComfyUI's ErnieImageModel keyword defaults: its detection writes none of them (the released model's widths).
_ERNIE = {"hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
          "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072, "rope_theta": 256,
          "rope_axes_dim": (32, 48, 48), "eps": 1e-6, "qk_layernorm": True}  # fmt: skip


def _ernie_image(cfg: dict) -> dict:
    return {k: cfg.get(k, default) for k, default in _ERNIE.items()}


def _cosmos_predict2(cfg: dict) -> dict:
    # ComfyUI's MiniTrainDIT (Cosmos-Predict2 and Anima's DiT); the extra per-block position embedding is
    # diffusers' "learnable" one.
    heads = cfg.get("num_heads", 16)
    return {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg["out_channels"],
        "num_attention_heads": heads,
        "attention_head_dim": cfg.get("model_channels", 2048) // heads,
        "num_layers": cfg.get("num_blocks", 28),
        "mlp_ratio": cfg.get("mlp_ratio", 4.0),
        "text_embed_dim": cfg.get("crossattn_emb_channels", 1024),
        "adaln_lora_dim": cfg.get("adaln_lora_dim", 256),
        "max_size": (cfg.get("max_frames", 128), cfg.get("max_img_h", 240), cfg.get("max_img_w", 240)),
        "patch_size": (
            cfg.get("patch_temporal", 1),
            cfg.get("patch_spatial", 2),
            cfg.get("patch_spatial", 2),
        ),
        "concat_padding_mask": bool(cfg.get("concat_padding_mask", True)),
        "extra_pos_embed_type": "learnable" if cfg.get("extra_per_block_abs_pos_emb") else None,
    }


# ComfyUI's LTXAVModel keyword defaults (LTX-2), for what its detection does not write.
_LTXAV = {"in_channels": 128, "audio_in_channels": 128, "cross_attention_dim": 4096, "audio_cross_attention_dim": 2048,
          "attention_head_dim": 128, "audio_attention_head_dim": 64, "num_attention_heads": 32,
          "audio_num_attention_heads": 32, "caption_channels": 3840, "num_layers": 48}  # fmt: skip


def _ltx2(cfg: dict) -> dict:
    out = {k: cfg.get(k, default) for k, default in _LTXAV.items()}
    out["out_channels"], out["audio_out_channels"] = out["in_channels"], out["audio_in_channels"]
    return out


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


def _wan_animate(cfg: dict) -> dict:
    # ComfyUI's AnimateWanModel is Wan I2V (image cross-attention on 1280-wide CLIP features projected to dim) plus
    # a face adapter every 5 blocks; its pose input (16 channels), face encoder (1024 x 4 heads) and 512 px motion
    # encoder are fixed, as in diffusers' defaults.
    return {**_wan(cfg), "added_kv_proj_dim": cfg["dim"], "image_dim": 1280, "latent_channels": 16}


def _ltx_video(cfg: dict) -> dict:
    # ComfyUI's detection reads the depth, the head width (at 32 heads) and the cross-attention width; the latent
    # and caption widths are LTXVModel's keyword arguments.
    in_channels = cfg.get("in_channels", 128)
    return {
        "in_channels": in_channels,
        "out_channels": in_channels,
        "num_attention_heads": cfg.get("num_attention_heads", 32),
        "attention_head_dim": cfg["attention_head_dim"],
        "cross_attention_dim": cfg["cross_attention_dim"],
        "num_layers": cfg["num_layers"],
        "caption_channels": cfg.get("caption_channels", 4096),
    }


def _pixart(cfg: dict) -> dict:
    # ComfyUI's PixArtMS: Alpha's size / aspect-ratio embedders when micro_condition is set (detected from
    # ar_embedder), a sigma-predicting output twice the input channels, the caption projected to the hidden width.
    hidden, heads, in_channels = (
        cfg.get("hidden_size", 1152),
        cfg.get("num_heads", 16),
        cfg.get("in_channels", 4),
    )
    return {
        "num_attention_heads": heads,
        "attention_head_dim": hidden // heads,
        "in_channels": in_channels,
        "out_channels": in_channels * 2 if cfg.get("pred_sigma", True) else in_channels,
        "num_layers": cfg["depth"],
        "cross_attention_dim": hidden,
        "patch_size": cfg.get("patch_size", 2),
        "caption_channels": cfg.get("caption_channels", 4096),
        "use_additional_conditions": bool(cfg.get("micro_condition", True)),
    }


def _sd3(cfg: dict) -> dict:
    # ComfyUI's MMDiT: hidden = 64 * depth, depth heads of 64; the caption projection is the hidden width.
    depth, context = cfg["depth"], cfg.get("context_embedder_config") or {}
    out = {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg.get("out_channels") or cfg["in_channels"],
        "patch_size": cfg.get("patch_size", 2),
        "num_layers": depth,
        "num_attention_heads": depth,
        "attention_head_dim": 64,
        "caption_projection_dim": 64 * depth,
        "dual_attention_layers": tuple(cfg.get("x_block_self_attn_layers") or ()),
        "qk_norm": "rms_norm" if cfg.get("qk_norm") == "rms" else None,
    }
    if cfg.get("adm_in_channels"):
        out["pooled_projection_dim"] = cfg["adm_in_channels"]
    if context.get("params"):
        out["joint_attention_dim"] = context["params"]["in_features"]
    if cfg.get("pos_embed_max_size"):
        out["pos_embed_max_size"] = cfg["pos_embed_max_size"]
    return out


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


def _lumina2(cfg: dict) -> dict:
    # ComfyUI's NextDiT feed-forward is ffn_dim_multiplier x dim wide; diffusers' is ffn_dim_multiplier x 4 x dim.
    return {
        "patch_size": cfg.get("patch_size", 2),
        "in_channels": cfg.get("in_channels", 16),
        "hidden_size": cfg["dim"],
        "num_layers": cfg["n_layers"],
        "num_refiner_layers": cfg.get("n_refiner_layers", 2),
        "num_attention_heads": cfg.get("n_heads", 24),
        "num_kv_heads": cfg.get("n_kv_heads", 8),
        "multiple_of": cfg.get("multiple_of", 256),
        "ffn_dim_multiplier": cfg.get("ffn_dim_multiplier", 4.0) / 4,
        "axes_dim_rope": tuple(cfg.get("axes_dims", (32, 32, 32))),
        "axes_lens": tuple(cfg.get("axes_lens", (300, 512, 512))),
        "cap_feat_dim": cfg["cap_feat_dim"],
    }


CONFIGS: dict[str, Callable[[dict], dict]] = {
    "sd1": _unet,
    "sd2": _unet,
    "sdxl": _unet,
    "sdxl-refiner": _unet,
    "flux": _flux,
    "flux-schnell": _flux,
    "wan": _wan,
    "wan-animate": _wan_animate,
    "ltx-video": _ltx_video,
    "pixart": _pixart,
    "sd3": _sd3,
    "flux2": _flux2,
    "chroma": _chroma,
    "hunyuan-video": _hunyuan_video,
    "ltx2": _ltx2,
    "lumina2": _lumina2,
    "qwen-image": _qwen_image,
    "z-image": _z_image,
    "hunyuan-video-1.5": _hunyuan_video_15,
    "hunyuan-image-2.1": _hunyuan_image_21,
    "kandinsky5": _kandinsky5,
    "ernie-image": _ernie_image,
    "anima": _cosmos_predict2,
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


# Config entries that set only the width of one layer's weight (Flux Fill / Kontext / control widen the patch input
# to 384 channels and set out_channels): the shipped skeleton serves them by resizing that axis. {key: (module path,
# axis, the key whose value stands where this one is None: diffusers' own spelling of out_channels)}.
_FLUX_WIDTHS = {"in_channels": ("x_embedder", 1, None), "out_channels": ("proj_out", 0, "in_channels")}
WIDTHS: dict[str, dict[str, tuple[str, int, str | None]]] = {
    "flux": _FLUX_WIDTHS,
    "flux-schnell": _FLUX_WIDTHS,
}


def reference_config(arch: str, unet_config: dict) -> dict:
    """diffusers config entries for `arch` read from ComfyUI's unet_config ({} where the catalog's stand)."""
    convert = CONFIGS.get(arch)
    return convert(unet_config) if convert is not None else {}
