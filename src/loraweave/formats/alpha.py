"""Where a part's scale γ comes from: `.alpha` tensor, then kohya/PEFT metadata, then 1."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .metadata import kohya_args, kohya_number
from .metadata import peft_config as peft_config_of


@dataclass(frozen=True)
class MetadataAlpha:
    """Alpha facts found in a file's `__metadata__` (or a PEFT adapter_config.json)."""

    kohya_alpha: float | None = None
    kohya_conv_alpha: float | None = None
    peft: dict | None = (
        None  # flat PEFT LoraConfig fields: r, lora_alpha, alpha_pattern, rank_pattern, use_rslora
    )

    @property
    def empty(self) -> bool:
        return self.kohya_alpha is None and self.kohya_conv_alpha is None and self.peft is None


def read_metadata_alpha(
    metadata: dict[str, str], peft_config: dict | None = None, source: str = "adapter"
) -> MetadataAlpha:
    """Alpha facts of a file's metadata; a malformed field raises AdapterMetadataError naming `source` and
    it."""
    kohya_alpha = kohya_number(metadata, "ss_network_alpha", source)
    args = kohya_args(metadata, source)
    conv_alpha = kohya_number(metadata, "ss_network_args: conv_alpha", source, args.get("conv_alpha"))
    return MetadataAlpha(kohya_alpha, conv_alpha, peft_config_of(metadata, peft_config, source))


def _peft_field(peft: dict, component_prefix: str, name: str):
    # diffusers pipeline saves prefix every field with the component name ("transformer.lora_alpha").
    for key in (f"{component_prefix}.{name}", name):
        if key in peft:
            return peft[key]
    return None


def _pattern_value(patterns: dict | None, module_path: str):
    # PEFT matches pattern keys against the end of the module name (regex `(.*\.)?<key>$`).
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module_path):
            return value
    return None


def _kohya_scale(alpha: float, rank: int, source: str) -> tuple[float, str]:
    # kohya's and LyCORIS's network init turn alpha 0 (or unset) into alpha = rank (no scaling); the `.alpha`
    # they write and `ss_network_alpha` mean the same. A literal 0 would train nothing.
    return (1.0, source + "=0_as_rank") if alpha == 0 else (alpha / rank, source)


def _peft_scale(peft: dict, component_prefix: str, module_path: str, rank: int) -> tuple[float, str] | None:
    """(γ, source) from a PEFT config: the module's alpha_pattern/rank_pattern entries, else lora_alpha / r
    (sqrt(r) with rsLoRA); None when the config gives no alpha."""
    alpha = _pattern_value(_peft_field(peft, component_prefix, "alpha_pattern"), module_path)
    r = _pattern_value(_peft_field(peft, component_prefix, "rank_pattern"), module_path)
    source = "metadata:peft_pattern" if alpha is not None or r is not None else "metadata:peft"
    alpha = alpha if alpha is not None else _peft_field(peft, component_prefix, "lora_alpha")
    r = r if r is not None else _peft_field(peft, component_prefix, "r")
    if alpha is None:
        return None
    r = int(r) if r else rank
    if _peft_field(peft, component_prefix, "use_rslora"):
        return float(alpha) / math.sqrt(r), source + "_rslora"
    return float(alpha) / r, source


def resolve_scale(
    alpha_tensor: float | None,
    scale_tensor: float | None,
    rank: int,
    is_conv: bool,
    module_path: str,
    component_prefix: str,
    meta: MetadataAlpha,
    network_alpha: float | None = None,
) -> tuple[float, str]:
    """Return (γ, source) for one LoRA part of rank `rank`: the first source the file gives, in this order.
    Whether a part takes alpha/rank at all is settled by resolve.planner.part_scale, which calls this.

    network_alpha: one alpha for every module that the architecture's trainers record in `__metadata__` (read
    after PEFT's config, before kohya's, as diffusers' MiniMax-H3 loader does)."""
    if scale_tensor is not None:
        return scale_tensor, "tensor:scale"
    if alpha_tensor is not None:
        return _kohya_scale(alpha_tensor, rank, "tensor:alpha")
    peft = _peft_scale(meta.peft, component_prefix, module_path, rank) if meta.peft is not None else None
    if peft is not None:
        return peft
    if network_alpha is not None:
        return network_alpha / rank, "metadata:alpha"
    if is_conv and meta.kohya_conv_alpha is not None:
        return _kohya_scale(meta.kohya_conv_alpha, rank, "metadata:conv_alpha")
    if meta.kohya_alpha is not None:
        return _kohya_scale(meta.kohya_alpha, rank, "metadata:ss_network_alpha")
    return 1.0, "default:1"
