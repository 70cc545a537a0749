"""Stable Diffusion UNets (SD1, SD2, SDXL, the SDXL refiner): detected as one family, told apart by the
cross-attention width; their original (LDM) names live in unet_original.py."""

from __future__ import annotations

from .encoders import CLIP_G, CLIP_H, CLIP_L
from .record import Architecture, BlockMap, ComfyFacets, Skeleton, Widths

_SD15_UNET = dict(
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768,
    attention_head_dim=8,
    layers_per_block=2,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
)
_SDXL_UNET = dict(
    block_out_channels=[320, 640, 1280],
    cross_attention_dim=2048,
    attention_head_dim=[5, 10, 20],
    transformer_layers_per_block=[1, 2, 10],
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816,
    layers_per_block=2,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
)

# The family detection names first; the cross-attention width (attn2 to_k/to_v input columns) names the
# release.
UNET = Architecture(
    "unet",
    signature=r"^(down_blocks|up_blocks|input_blocks|output_blocks|mid_block|middle_block)_",
    widths=Widths(r"attn2_to_[kv]$", {768: "sd1", 1024: "sd2", 2048: "sdxl", 1280: "sdxl-refiner"}),
)
# Block slots: every supported UNet has 2 layers per down block (3 per up block). The LBW short layout lists
# the attention-bearing blocks; the preset splits are the last shallow input / first shallow output index (a
# downsampler belongs with the block before it: SD1 IN03 shallow, IN06 deep; SDXL IN06 shallow).
# SD1.5 and SD2 share the UNet block layout (4 down blocks).
SD1_BLOCKS = BlockMap(
    "sd1",
    unet=(
        4,
        (
            "BASE",
            "IN01",
            "IN02",
            "IN04",
            "IN05",
            "IN07",
            "IN08",
            "M00",
            "OUT03",
            "OUT04",
            "OUT05",
            "OUT06",
            "OUT07",
            "OUT08",
            "OUT09",
            "OUT10",
            "OUT11",
        ),
        (4, 7),
    ),
)


def _unet_from_comfy(cfg: dict) -> dict:
    """ComfyUI's UNet config -> diffusers' UNet2DConditionModel config at the model's widths and depths."""
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
    """diffusers' own spelling (what the shipped skeletons store): one int where every cross-attention level
    has the same depth (levels without attention ignore theirs), else one entry per level."""
    cross = {d for d in depths if d > 0}
    return cross.pop() if len(cross) == 1 else tuple(max(1, d) for d in depths)


SD1 = Architecture(
    "sd1",
    label="SD1.5",
    skeleton=Skeleton(
        "unet", "UNet2DConditionModel", _SD15_UNET, {"text_encoder": CLIP_L}, "sd15 unet config"
    ),
    cli_names=("unet", "sd15", "sd1.5"),
    blocks=SD1_BLOCKS,
    comfy=ComfyFacets(("SD15",), _unet_from_comfy, skeleton="sd1"),
)
SD2 = Architecture(
    "sd2",
    label="SD2",
    skeleton=Skeleton(
        "unet",
        "UNet2DConditionModel",
        {
            **_SD15_UNET,
            "cross_attention_dim": 1024,
            "attention_head_dim": [5, 10, 20, 20],
            "use_linear_projection": True,
        },
        {"text_encoder": CLIP_H},
        "sd15 config with SD2 attention",
    ),
    cli_names=("sd21",),
    blocks=SD1_BLOCKS,
    comfy=ComfyFacets(("SD20", "SD21UnclipL", "SD21UnclipH"), _unet_from_comfy, skeleton="sd2"),
)
SDXL = Architecture(
    "sdxl",
    label="SDXL",
    skeleton=Skeleton(
        "unet",
        "UNet2DConditionModel",
        _SDXL_UNET,
        {"text_encoder": CLIP_L, "text_encoder_2": CLIP_G},
        "sdxl-base unet config",
    ),
    blocks=BlockMap(
        "sdxl",
        unet=(
            3,
            (
                "BASE",
                "IN04",
                "IN05",
                "IN07",
                "IN08",
                "M00",
                "OUT00",
                "OUT01",
                "OUT02",
                "OUT03",
                "OUT04",
                "OUT05",
            ),
            (6, 3),
        ),
    ),
    comfy=ComfyFacets(("SDXL",), _unet_from_comfy, skeleton="sdxl"),
)
SDXL_REFINER = Architecture(
    "sdxl-refiner",
    label="SDXL refiner",
    skeleton=Skeleton(
        "unet",
        "UNet2DConditionModel",
        {
            **_SDXL_UNET,
            "block_out_channels": [384, 768, 1536, 1536],
            "cross_attention_dim": 1280,
            "attention_head_dim": [6, 12, 24, 24],
            "transformer_layers_per_block": 4,
            "projection_class_embeddings_input_dim": 2560,
            "down_block_types": [
                "DownBlock2D",
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "DownBlock2D",
            ],
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        },
        {"text_encoder_2": CLIP_G},
        "sdxl-refiner unet config",
    ),
    comfy=ComfyFacets(("SDXLRefiner",), _unet_from_comfy, skeleton="sdxl-refiner"),
)
