"""MiniMax-H3: original (MiniMaxAI, ComfyUI, ai-toolkit, musubi-tuner, DiffSynth-Studio) names -> diffusers
MiniMaxH3Transformer3DModel modules.

Source: diffusers `_convert_non_diffusers_minimax_h3_lora_to_diffusers` and
`convert_minimax_h3_transformer_checkpoint_to_diffusers`.

- `attn.qkv_proj` is q | k | v in equal thirds, except in DiffSynth-Studio files: DiffSynth runs the raw
  shards' per-head interleaved QKV ([head 0: q k v, head 1: q k v, ...], 128-row heads, as the converter
  hard-codes), and diffusers tells its files by peft's `.default.` adapter name, file-wide (trait
  "diffsynth").
- `mlp.fc1` is the SwiGLU [gate; value]; diffusers' `ff.net.0.proj` is [value; gate]: the halves swap, rows
  only (the converter swaps the `lora_B` halves; `lora_A` is shared).
- The refiner's `token_refiner.blocks.N` is `token_refiner.refiner_blocks.N` (no AdaLN projection there).
  Two trainers name the refiner with split projections: lightx2v's
  `token_refiner.refiner_blocks.N.attn.k_proj` (Wan2GP #2101) and Fizgig's
  `token_refiner_blocks.N.attn.q_proj` (Wan2GP #2126); `q/k/v_proj` are the separate `to_q/to_k/to_v`,
  and lightx2v's `refiner_blocks` spelling takes the fused names too.

Alpha: per-module `.alpha` tensors are alpha / rank (the converter's fold); without any in the file, a numeric
`__metadata__["alpha"]` is one network alpha for every module, else α = rank (scale 1). Unlike diffusers, a
non-numeric `alpha` entry is refused (AdapterMetadataError) instead of ignored with a warning.

Partitions: the file's keys go to the pipeline's `transformer` (every published H3 LoRA targets it); to
`transformer_ref` when that is the only partition given, when the keys say `transformer_ref.`, or with
`component_strengths={"transformer_ref": 1.0}` (diffusers' `load_into_transformer_ref=True`).
"""

from __future__ import annotations

from .record import Architecture, Layouts, Modalities, Skeleton
from .spec import Alias, ArchTable, Rows

HEAD_ROWS = (
    128  # every released MiniMax-H3 partition; the converter reads the head count off the rows with it
)


def _block(src: str, dst: str, adaln: bool) -> tuple[Alias, ...]:
    qkv = (f"{dst}.attn.to_q", f"{dst}.attn.to_k", f"{dst}.attn.to_v")
    ff = f"{dst}.ff.net.0.proj"
    return (
        Alias(f"{src}.attn.qkv_proj", qkv),
        Alias(f"{src}.attn.qkv_proj", qkv, interleave=HEAD_ROWS, when_file="diffsynth"),
        Alias(f"{src}.attn.out_proj", (f"{dst}.attn.to_out.0",)),
        Alias(f"{src}.mlp.fc1", (Rows(ff, 1, 2), Rows(ff, 0, 2))),
        Alias(f"{src}.mlp.fc2", (f"{dst}.ff.net.2",)),
        *((Alias(f"{src}.adaln_proj.linear", (f"{dst}.adaln_proj.linear",)),) if adaln else ()),
    )


def _split_refiner(src: str) -> tuple[Alias, ...]:
    """A refiner block's projections under split original names (`attn.q_proj`, `attn.k_proj`, ...)."""
    dst = "token_refiner.refiner_blocks.{i}.attn"
    return tuple(Alias(f"{src}.attn.{x}_proj", (f"{dst}.to_{x}",)) for x in "qkv")


MINIMAX_H3 = ArchTable(
    name="minimax-h3",
    classes=("MiniMaxH3Transformer3DModel",),
    aliases=(
        *_block("blocks.{i}", "transformer_blocks.{i}", adaln=True),
        *_block("token_refiner.blocks.{i}", "token_refiner.refiner_blocks.{i}", adaln=False),
        *_block("token_refiner.refiner_blocks.{i}", "token_refiner.refiner_blocks.{i}", adaln=False),
        *_split_refiner("token_refiner.blocks.{i}"),
        *_split_refiner("token_refiner.refiner_blocks.{i}"),
        Alias("video_patch_proj", ("proj_in",)),
        Alias("audio_patch_proj", ("audio_proj_in",)),
        Alias("condition_proj", ("context_embedder",)),
        Alias("time_embedder.proj_in", ("time_embedder.linear_1",)),
        Alias("time_embedder.proj_out", ("time_embedder.linear_2",)),
        Alias("final_layer.adaln_proj.linear", ("norm_out.linear",)),
        Alias("final_layer.video_out", ("proj_out",)),
        Alias("final_layer.audio_out", ("audio_proj_out",)),
    ),
    metadata_alpha="alpha",
)

# One joint stream: every block attends over the packed video, text and audio rows (diffusers: "no
# per-modality block weights"), so only the patch projections and output heads belong to one modality.
MINIMAX_H3_MODALITIES = Modalities(
    rules=(
        ("audio", r"^\.(audio_proj_(in|out)|audio_patch_proj|final_layer\.audio_out)$"),
        ("video", r"^\.(proj_(in|out)|video_patch_proj|final_layer\.video_out)$"),
    ),
    default="cross",
)

# Original names: fused `attn.qkv_proj`, `mlp.fc1/2`, a refiner under `token_refiner.blocks`.
MINIMAX_H3_ARCH = Architecture(
    "minimax-h3",
    (MINIMAX_H3,),
    label="MiniMax-H3",
    signature=r"^(token_refiner_)?blocks_\d+_(attn_(qkv|out)_proj|mlp_fc[12]|adaln_proj_linear)$"
    r"|^token_refiner_(refiner_)?blocks_\d+_attn_[qkv]_proj$"
    r"|^(condition_proj|video_patch_proj|audio_patch_proj)$",
    skeleton=Skeleton(
        "transformer",
        "MiniMaxH3Transformer3DModel",
        {},
        {},
        "MiniMaxH3Transformer3DModel defaults (50 blocks, hidden 5376, 2 refiner blocks)",
    ),
    cli_names=("minimax",),
    layouts=Layouts(
        "minimax-h3",
        "MiniMaxAI/ComfyUI names (bare, diffusion_model.), musubi-tuner (lora_unet_), DiffSynth-Studio "
        "(.default., per-head interleaved QKV); fc1 halves swapped; .alpha, __metadata__ alpha; "
        "transformer_ref partition; refiner split q/k/v_proj (lightx2v refiner_blocks., Fizgig "
        "token_refiner_blocks.)",
        "_convert_non_diffusers_minimax_h3_lora_to_diffusers, MiniMaxH3LoraLoaderMixin.lora_state_dict",
        "test_arch_minimax_ideogram_qwen21.py::test_minimax_h3_*, test_arch_layout_classes.py::test_h3_*",
    ),
    modalities=MINIMAX_H3_MODALITIES,
)
