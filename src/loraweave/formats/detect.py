"""Which architecture an adapter file was trained for, from its key names and shapes; the answer carries its
evidence. Metadata is reported but never trusted over the keys (a real Flux file says `sd_1.5`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .adapter import Adapter

# (architecture, key-name signature). Every part path is matched in underscore form, so one pattern covers
# dotted, kohya and ComfyUI spellings. The most specific architectures come first.
SIGNATURES: tuple[tuple[str, str], ...] = (
    ("flux2", r"double_stream_modulation|single_stream_modulation|to_qkv_mlp_proj"),
    ("sd3", r"^joint_blocks_\d+_(x|context)_block"),
    # HunyuanVideo's `img_mod.linear` / `modulation.linear` / `mlp.fc1` vs Flux's `img_mod.lin` / `img_mlp.0`.
    ("hunyuan-video", r"^(double|single)_blocks_\d+_.*(mod_linear|modulation_linear|mlp_fc[12])$|individual_token_refiner|token_refiner_refiner_blocks"),
    ("chroma", r"^distilled_guidance_layer"),
    ("flux", r"^double_blocks_\d+_(img|txt)_|^single_blocks_\d+_linear[12]|^single_transformer_blocks_\d+_"),
    ("qwen-image", r"^transformer_blocks_\d+_(img|txt)_(mlp|mod)"),
    # diffusers double-stream (MMDiT) names are shared by SD3 and Flux: told apart by width below.
    ("mmdit", r"^transformer_blocks_\d+_(attn_(add_[qkv]_proj|to_add_out|to_[qkv]|to_out)|attn2_|ff_context|ff_net|norm1)"),
    ("z-image", r"^(layers|noise_refiner|context_refiner)_\d+_(attention|feed_forward|adaLN)"),
    ("anima", r"^blocks_\d+_(self_attn|cross_attn)_[qkvo]_proj|^blocks_\d+_mlp_layer"),
    # Wan Animate: Wan blocks plus the face adapter / face and motion encoders (original or diffusers names).
    ("wan-animate", r"^face_adapter_(fuser_blocks_)?\d+_|^(motion|face)_encoder_"),
    # Wan-Animate-2's official checkpoint wraps every block: `blocks.N.block.self_attn.q`.
    ("wan-animate-2", r"^blocks_\d+_block_(self_attn|cross_attn|ffn|norm3)"),
    ("wan", r"^blocks_\d+_(self_attn|cross_attn|attn1|attn2|ffn)"),
    ("unet", r"^(down_blocks|up_blocks|input_blocks|output_blocks|mid_block|middle_block)_"),
)

# UNet families told apart by the cross-attention width (attn2 to_k/to_v input columns).
UNET_BY_CONTEXT = {768: "sd1", 1024: "sd2", 2048: "sdxl", 1280: "sdxl-refiner"}
# diffusers MMDiT files by hidden width (input columns of attn.to_q): SD3 medium / SD3.5 large / Flux.1.
MMDIT_BY_WIDTH = {1536: "sd3", 2432: "sd3", 3072: "flux"}
METADATA_KEYS = ("modelspec.architecture", "ss_base_model_version", "ss_sd_model_name")


@dataclass
class Detection:
    architecture: str  # "unknown" when no signature matched
    evidence: list[str] = field(default_factory=list)
    scores: dict[str, int] = field(default_factory=dict)  # parts matched per architecture
    metadata: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"architecture": self.architecture, "evidence": self.evidence, "scores": self.scores,
                "metadata": self.metadata}


def _order(arch: str) -> int:
    names = [s[0] for s in SIGNATURES]
    return names.index(arch) if arch in names else names.index("mmdit")


def _unet_kind(adapter: Adapter) -> tuple[str, str] | None:
    for part in adapter.parts:
        if re.search(r"attn2_to_[kv]$", part.path.replace(".", "_")) and "down" in part.roles:
            width = adapter.shape(part.roles["down"])[1]
            kind = UNET_BY_CONTEXT.get(width)
            if kind:
                return kind, f"cross-attention input width {width} ({part.stem})"
    return None


def _mmdit_kind(adapter: Adapter) -> tuple[str, str] | None:
    for part in adapter.parts:
        path = part.path.replace(".", "_")
        if re.search(r"^transformer_blocks_\d+_attn2_", path):
            return "sd3", f"dual attention (attn2) in a joint block: SD3.5 ({part.stem})"
        if re.search(r"^transformer_blocks_\d+_attn_to_q$", path) and "down" in part.roles:
            width = adapter.shape(part.roles["down"])[1]
            if width in MMDIT_BY_WIDTH:
                return MMDIT_BY_WIDTH[width], f"joint-block hidden width {width} ({part.stem})"
    return None


def detect_architecture(adapter: Adapter) -> Detection:
    scores: dict[str, int] = {}
    first: dict[str, str] = {}
    for part in adapter.parts:
        if part.component != "denoiser":
            continue
        path = part.path.replace(".", "_")
        for arch, pattern in SIGNATURES:
            if re.search(pattern, path):
                scores[arch] = scores.get(arch, 0) + 1
                first.setdefault(arch, part.stem)
                break
    meta = {k: adapter.metadata[k] for k in METADATA_KEYS if k in adapter.metadata}
    if not scores and any(p.layout == "cloneofsimo" for p in adapter.parts):
        return Detection("unet", ["cloneofsimo positional keys (unet:<i>): an SD1.x/SD2.x UNet"], {}, meta)
    if not scores:
        return Detection("unknown", ["no key matched a known architecture signature"], scores, meta)
    if "mmdit" in scores:
        kind = _mmdit_kind(adapter)
        # Flux files also have single blocks; an SD3/Flux width fact decides where the shared names count.
        name = kind[0] if kind else ("flux" if "flux" in scores else "sd3-or-flux")
        scores[name] = scores.get(name, 0) + scores.pop("mmdit")
        first.setdefault(name, first.pop("mmdit"))
    if "wan-animate" in scores and "wan" in scores:  # Animate's transformer blocks are Wan's
        scores["wan-animate"] += scores.pop("wan")
    arch = max(scores, key=lambda a: (scores[a], -_order(a)))
    evidence = [f"{scores[arch]} of {len(adapter.parts)} parts match {arch} names, e.g. {first[arch]}"]
    if arch in ("sd3", "flux", "sd3-or-flux") and (kind := _mmdit_kind(adapter)):
        evidence.append(kind[1])
    if arch == "unet":
        kind = _unet_kind(adapter)
        if kind:
            arch = kind[0]
            evidence.append(kind[1])
    if meta:
        said = " ".join(meta.values()).lower()
        agrees = arch.split("-")[0] in said.replace("_", "").replace(".", "").replace("sd1.5", "sd1")
        evidence.append(f"metadata {meta} {'agrees' if agrees else 'disagrees; keys win'}")
    return Detection(arch, evidence, scores, meta)
