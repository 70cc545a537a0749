"""Original (ldm / sgm) <-> diffusers module names for ``UNet2DConditionModel``.

The original UNet is a flat sequence: ``input_blocks.N`` (conv_in, then per level one entry
per resnet, each optionally followed by its transformer, then the downsampler),
``middle_block.N`` and ``output_blocks.N``.  The numbering is recovered by walking the live
diffusers model, so per-level ``layers_per_block`` lists and levels without attention or
without a resampler fall out naturally.  Only module names are used (meta models work).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

# Modules outside the blocks.  ldm has a single ``label_emb``: SDXL's is diffusers'
# ``add_embedding``; class-conditioned models (e.g. stable unCLIP) use ``class_embedding``.
_TOP_LEVEL: dict[str, str] = {
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
    "label_emb.0.0": "add_embedding.linear_1",
    "label_emb.0.2": "add_embedding.linear_2",
    "input_blocks.0.0": "conv_in",
    "out.0": "conv_norm_out",
    "out.2": "conv_out",
}
_CLASS_EMBEDDING: dict[str, str] = {
    "label_emb": "class_embedding",  # integer num_classes: a plain nn.Embedding
    "label_emb.0.0": "class_embedding.linear_1",
    "label_emb.0.2": "class_embedding.linear_2",
}

# diffusers child name -> original child name, per block kind.  ``None`` keeps names as-is
# (the transformer blocks were ported verbatim, including ``proj_in`` being a Linear or a
# 1x1 Conv2d depending on ``use_linear_projection``).
_RESNET: dict[str, str] = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_DOWNSAMPLER: dict[str, str] = {"conv": "op"}
_UPSAMPLER: dict[str, str] = {"conv": "conv"}

_Pair = tuple[str, str, dict[str, str] | None]  # (original prefix, diffusers prefix, renames)


def _has_params(module: torch.nn.Module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _children(block: torch.nn.Module, attr: str) -> list[torch.nn.Module]:
    # attention-free blocks lack ``attentions``; blocks without a resampler hold ``None``
    return list(getattr(block, attr, None) or [])


def _module_list(module: torch.nn.Module, attr: str) -> torch.nn.ModuleList:
    return getattr(module, attr)  # Module.__getattr__ is typed Tensor | Module; diffusers holds a ModuleList


def _block_pairs(unet: torch.nn.Module) -> Iterator[_Pair]:
    n = 1  # input_blocks.0 is conv_in
    for i, block in enumerate(_module_list(unet, "down_blocks")):
        attentions = _children(block, "attentions")
        for j in range(len(_module_list(block, "resnets"))):
            yield f"input_blocks.{n}.0", f"down_blocks.{i}.resnets.{j}", _RESNET
            if j < len(attentions):
                yield f"input_blocks.{n}.1", f"down_blocks.{i}.attentions.{j}", None
            n += 1
        if _children(block, "downsamplers"):
            yield f"input_blocks.{n}.0", f"down_blocks.{i}.downsamplers.0", _DOWNSAMPLER
            n += 1

    mid = getattr(unet, "mid_block", None)
    if mid is not None:
        # middle_block interleaves resnets.0, attentions.0, resnets.1, attentions.1, ...
        mid_attentions = _children(mid, "attentions")
        n = 0
        for j in range(len(_module_list(mid, "resnets"))):
            yield f"middle_block.{n}", f"mid_block.resnets.{j}", _RESNET
            n += 1
            if j < len(mid_attentions):
                yield f"middle_block.{n}", f"mid_block.attentions.{j}", None
                n += 1

    n = 0
    for i, block in enumerate(_module_list(unet, "up_blocks")):
        attentions = _children(block, "attentions")
        last = len(_module_list(block, "resnets")) - 1
        for j in range(len(_module_list(block, "resnets"))):
            yield f"output_blocks.{n}.0", f"up_blocks.{i}.resnets.{j}", _RESNET
            if j < len(attentions):
                yield f"output_blocks.{n}.1", f"up_blocks.{i}.attentions.{j}", None
            # the upsampler shares the last layer's Sequential, after its transformer if any
            if j == last and _children(block, "upsamplers"):
                slot = 2 if j < len(attentions) else 1
                yield f"output_blocks.{n}.{slot}", f"up_blocks.{i}.upsamplers.0", _UPSAMPLER
            n += 1


def unet_original_names(unet: torch.nn.Module) -> dict[str, str]:
    """Map every parameterised original (ldm/sgm) UNet module path to its diffusers path.

    Keys have no ``model.diffusion_model.`` prefix and no ``.weight``/``.bias`` suffix, e.g.
    ``"input_blocks.4.1.transformer_blocks.0.attn1.to_q"`` ->
    ``"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"``.  Only modules that
    exist in ``unet`` and own parameters are included.
    """
    mapping: dict[str, str] = {}
    top = dict(_TOP_LEVEL)
    if getattr(unet, "add_embedding", None) is None:
        top.update(_CLASS_EMBEDDING)
    for original, diffusers_name in top.items():
        try:
            module = unet.get_submodule(diffusers_name)
        except AttributeError:
            continue
        if _has_params(module):
            mapping[original] = diffusers_name

    try:
        pairs = list(_block_pairs(unet))
    except (AttributeError, TypeError) as exc:
        # a non-standard UNet (blocks without resnets, a partial folder): the numbering cannot be
        # recovered, so original names stay unmapped (reported as misses) rather than misnamed
        log.warning("unet_original=skipped reason=%r", f"{type(exc).__name__}: {exc}")
        return mapping
    for original_prefix, diffusers_prefix, renames in pairs:
        for sub, module in unet.get_submodule(diffusers_prefix).named_modules():
            if not sub or not _has_params(module):
                continue
            original_sub = sub
            if renames is not None:
                head, dot, rest = sub.partition(".")
                if head not in renames:  # unknown layout: leave it unmapped, never misnamed
                    continue
                original_sub = renames[head] + dot + rest
            mapping[f"{original_prefix}.{original_sub}"] = f"{diffusers_prefix}.{sub}"
    return mapping
