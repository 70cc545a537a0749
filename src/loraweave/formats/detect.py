"""Which architecture an adapter file was trained for, from its key names and shapes; the answer carries its
evidence. Metadata is reported but never trusted over the keys (a real Flux file says `sd_1.5`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .adapter import Adapter
from .blocks import highest_blocks

# (architecture, key-name signature). Every part path is matched in underscore form, so one pattern covers
# dotted, kohya and ComfyUI spellings. The most specific architectures come first.
SIGNATURES: tuple[tuple[str, str], ...] = (
    ("flux2", r"double_stream_modulation|single_stream_modulation|to_qkv_mlp_proj"),
    ("sd3", r"^joint_blocks_\d+_(x|context)_block"),
    # LTX-2.3 adds attention gates and prompt modulation to LTX-2; both add an audio tower to MMDiT-like blocks.
    ("ltx2.3", r"_to_gate_logits$|^(audio_)?prompt_adaln(_single)?_"),
    (
        "ltx2",
        r"^transformer_blocks_\d+_(audio_(attn[12]|ff)|audio_to_video_attn|video_to_audio_attn)_"
        r"|^audio_adaln_single_|^av_ca_|^av_cross_attn_|^(audio_)?patchify_proj$|^audio_caption_projection_",
    ),
    # HunyuanVideo's `img_mod.linear` / `modulation.linear` / `mlp.fc1` vs Flux's `img_mod.lin` / `img_mlp.0`.
    (
        "hunyuan-video",
        r"^(double|single)_blocks_\d+_.*(mod_linear|modulation_linear|mlp_fc[12])$|individual_token_refiner|token_refiner_refiner_blocks",
    ),
    # MiniMax-H3 original names: fused `attn.qkv_proj`, `mlp.fc1/2`, a refiner under `token_refiner.blocks`.
    (
        "minimax-h3",
        r"^(token_refiner_)?blocks_\d+_(attn_(qkv|out)_proj|mlp_fc[12]|adaln_proj_linear)$"
        r"|^(condition_proj|video_patch_proj|audio_patch_proj)$",
    ),
    ("chroma", r"^distilled_guidance_layer"),
    ("flux", r"^double_blocks_\d+_(img|txt)_|^single_blocks_\d+_linear[12]|^single_transformer_blocks_\d+_"),
    # Qwen-Image 2.1's SwiGLU (`gate_layer` / `proj` / `out`, ComfyUI's fused `gate_up`) vs Qwen-Image's `net.0.proj`.
    ("qwen-image-2.1", r"^transformer_blocks_\d+_img_mlp_(gate_up|gate_layer|proj|out)$"),
    ("qwen-image", r"^transformer_blocks_\d+_(img|txt)_(mlp|mod)"),
    # Kandinsky 6 (audio tower, `attn.`, FeedForward `net`) shares Kandinsky 5's block names otherwise.
    (
        "kandinsky6",
        r"^(audio_)?(visual|text)_transformer_blocks_\d+_(attn_|feed_forward_net_)|^audio_text_transformer_blocks_",
    ),
    ("kandinsky5", r"^(visual|text)_transformer_blocks_\d+_"),
    ("ernie-image", r"^layers_\d+_(self_attention_(to_[qkv]|to_out_0)|mlp_(gate_proj|up_proj|linear_fc2))$"),
    # Sana's GLUMBConv feed-forward in diffusers names (its attention names are the cross-attention DiTs' below).
    ("sana", r"^transformer_blocks_\d+_ff_conv_(inverted|depth|point)$"),
    # diffusers self-attention `attn1` next to cross-attention `attn2`: the cross-attention DiTs (LTX-Video,
    # LTX-2's video tower, PixArt, Sana); SD3.5's dual attention pairs `attn2` with the joint `attn`, never `attn1`.
    ("cross-dit", r"^transformer_blocks_\d+_attn1_"),
    # diffusers double-stream (MMDiT) names are shared by SD3 and Flux: told apart by width below.
    (
        "mmdit",
        r"^transformer_blocks_\d+_(attn_(add_[qkv]_proj|to_add_out|to_[qkv]|to_out)|attn2_|ff_context|ff_net|norm1)",
    ),
    # Ideogram4's own original names; its fused `attention.qkv` and `feed_forward.w1-3` are Z-Image's (shared below).
    ("ideogram4", r"^layers_\d+_(attention_o|adaln_modulation)$"),
    (
        "lumina2",
        r"^(layers|noise_refiner|context_refiner)_\d+_(attn_(to_[qkv]|to_out_0)|feed_forward_linear_[123]|norm1_linear)$",
    ),
    # Z-Image and Lumina2 original (NextDiT) names are the same: told apart by width below.
    ("z-image", r"^(layers|noise_refiner|context_refiner)_\d+_(attention|feed_forward|adaLN)"),
    ("anima", r"^blocks_\d+_(self_attn|cross_attn)_[qkvo]_proj|^blocks_\d+_mlp_layer"),
    # Sana original names; its `cross_attn` would otherwise count as Wan's.
    (
        "sana",
        r"^blocks_\d+_(attn_(qkv|proj)|cross_attn_(q_linear|kv_linear|proj)|mlp_(inverted|depth|point)_conv_conv)$",
    ),
    # Wan Animate: Wan blocks plus the face adapter / face and motion encoders (original or diffusers names).
    ("wan-animate", r"^face_adapter_(fuser_blocks_)?\d+_|^(motion|face)_encoder_"),
    # Wan-Animate-2's official checkpoint wraps every block: `blocks.N.block.self_attn.q`.
    ("wan-animate-2", r"^blocks_\d+_block_(self_attn|cross_attn|ffn|norm3)"),
    ("wan", r"^blocks_\d+_(self_attn|cross_attn|attn1|attn2|ffn)"),
    ("unet", r"^(down_blocks|up_blocks|input_blocks|output_blocks|mid_block|middle_block)_"),
)
# Names several architectures share -> the architectures that own them, most specific first: when one of those
# scored (its own names are in the file), the shared names count for it.
SHARED_NAMES: dict[str, tuple[str, ...]] = {
    # cross-dit: a cross-attention DiT's attn2 / ff.net names go where its attn1 names go (below), not to SD3.5
    "mmdit": ("ltx2.3", "ltx2", "qwen-image-2.1", "qwen-image", "cross-dit"),
    "qwen-image": ("qwen-image-2.1",),
    "ltx2": ("ltx2.3",),
    "z-image": ("ideogram4", "lumina2"),
    "wan": ("wan-animate",),
    "kandinsky5": ("kandinsky6",),
    "flux": ("hunyuan-video", "hunyuan-image-2.1"),  # diffusers single-block names; else by MMDiT width below
    "cross-dit": ("ltx2.3", "ltx2", "sana"),  # else by the hidden width (BY_WIDTH)
}
# Architectures that share block names at one width, told apart by how deep the file goes: the first whose block
# counts per chain (formats.blocks) hold the file's. Flux.1 (and Chroma) have 19 double / 38 single blocks,
# HunyuanVideo 20 / 40 (both 24 heads x 128; arch.variants lists the same releases), Qwen-Image 60 double-stream
# blocks only (its attention names are Flux's); a file that stops early keeps the shallowest.
BY_DEPTH: dict[str, tuple[tuple[str, dict[str, int]], ...]] = {
    "flux": (
        ("flux", {"double": 19, "single": 38}),
        ("hunyuan-video", {"double": 20, "single": 40}),
        ("qwen-image", {"double": 60}),
    ),
}

# UNet families told apart by the cross-attention width (attn2 to_k/to_v input columns).
UNET_BY_CONTEXT = {768: "sd1", 1024: "sd2", 2048: "sdxl", 1280: "sdxl-refiner"}
# diffusers MMDiT files by hidden width (input columns of attn.to_q): SD3 medium / SD3.5 large / Flux.1 /
# HunyuanVideo 1.5 (16 heads x 128, double-stream blocks only) / HunyuanImage 2.1 (28 heads x 128), class defaults.
MMDIT_BY_WIDTH = {
    1536: "sd3",
    2432: "sd3",
    3072: "flux",
    2048: "hunyuan-video-1.5",
    3584: "hunyuan-image-2.1",
}
# Shared names no owner claimed, told apart by the hidden width (input columns of a part the pattern names):
# Z-Image dim 3840 (z-image-turbo config), Lumina-Image-2.0 hidden 2304 (the q width diffusers' Lumina2 LoRA
# converter hard-codes), Ideogram4 18 heads x 256 (class defaults). Another width keeps the first owner, z-image.
# Cross-attention DiTs by attn1.to_q's input width (class defaults): LTX-2 (32 heads x 128; a video-only file has
# no audio names; LTX-Video 13B has the same names and sizes, and lands the same), LTX-Video 0.9 2B (32 x 64),
# PixArt-alpha/Sigma (16 x 72; Sana 600M shares the width, its own ff_conv names claim it first), Sana 1600M.
# Another width stays "cross-dit": a family, no release named.
BY_WIDTH: dict[str, tuple[str, dict[int, str]]] = {
    "z-image": (
        r"^(layers|noise_refiner|context_refiner)_\d+_attention_(qkv|to_q)$",
        {3840: "z-image", 2304: "lumina2", 4608: "ideogram4"},
    ),
    "cross-dit": (
        r"^transformer_blocks_\d+_attn1_to_q$",
        {4096: "ltx2", 2048: "ltx-video", 1152: "pixart", 2240: "sana"},
    ),
}
# The releases BY_WIDTH names for the cross-attention DiTs read their text at the hidden width (cross_attention_dim
# = hidden in all four): a file whose attn2 keys take another width (diffusers-named Cosmos-Predict2: 1024-wide text
# at 2048) is none of them and stays "cross-dit".
SAME_WIDTH = {"cross-dit": r"^transformer_blocks_\d+_attn2_to_k$"}
METADATA_KEYS = ("modelspec.architecture", "ss_base_model_version", "ss_sd_model_name")


@dataclass
class Detection:
    architecture: str  # "unknown" when no signature matched
    evidence: list[str] = field(default_factory=list)
    scores: dict[str, int] = field(default_factory=dict)  # parts matched per architecture
    metadata: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "architecture": self.architecture,
            "evidence": self.evidence,
            "scores": self.scores,
            "metadata": self.metadata,
        }


def _order(arch: str) -> int:
    names = [s[0] for s in SIGNATURES]
    return names.index(arch) if arch in names else names.index("mmdit")


def _unet_kind(adapter: Adapter) -> tuple[str, str] | None:
    found = _width_of(adapter, r"attn2_to_[kv]$", UNET_BY_CONTEXT)
    return (
        (UNET_BY_CONTEXT[found[0]], f"cross-attention input width {found[0]} ({found[1]})") if found else None
    )


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


def _width_of(adapter: Adapter, pattern: str, known=None) -> tuple[int, str] | None:
    """(input width, part) of the first part whose path matches `pattern` and has a 2-D `down` factor (whose
    width is in `known`, when given)."""
    for part in adapter.parts:
        if re.search(pattern, part.path.replace(".", "_")) and "down" in part.roles:
            shape = adapter.shape(part.roles["down"])
            if len(shape) == 2 and (known is None or shape[1] in known):
                return int(shape[1]), part.stem
    return None


def _deeper(adapter: Adapter, arch: str) -> tuple[str, str] | None:
    """(architecture, why) when the file indexes blocks `arch` does not have and a BY_DEPTH sibling does."""
    tops = highest_blocks([p.path for p in adapter.parts])
    fits = [
        name for name, chains in BY_DEPTH[arch] if all(top < chains.get(c, 0) for c, (top, _) in tops.items())
    ]
    if not fits or fits[0] == arch:
        return None
    own = dict(BY_DEPTH[arch])[arch]
    chain, (top, at) = next((c, t) for c, t in tops.items() if t[0] >= own.get(c, 0))
    return fits[0], f"{chain}-stream block {top} ({adapter.parts[at].stem}): more blocks than {arch} has"


def _fold_shared(adapter: Adapter, scores: dict[str, int], first: dict[str, str]) -> list[tuple[str, str]]:
    """Shared names count for the owner whose own names the file has, else for the one their width names.
    Returns (architecture, why) for the evidence."""
    out = []
    for shared, owners in SHARED_NAMES.items():
        owner = next((o for o in owners if o in scores), None)
        why = f"{shared} names shared with {owner}'s own names" if owner else ""
        if owner is None and shared in scores and shared in BY_WIDTH:
            pattern, by_width = BY_WIDTH[shared]
            found = _width_of(adapter, pattern)
            owner = by_width.get(found[0]) if found else None
            why = f"hidden width {found[0]} ({found[1]})" if found else why
            other = _width_of(adapter, SAME_WIDTH[shared]) if found and shared in SAME_WIDTH else None
            owner = None if other and other[0] != found[0] else owner  # e.g. Cosmos: 1024-wide text at 2048
        if owner not in (None, shared) and shared in scores:
            scores[owner] = scores.get(owner, 0) + scores.pop(shared)
            first.setdefault(owner, first.pop(shared))
            out.append((owner, why))
    return out


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
    folded = _fold_shared(adapter, scores, first)
    if "mmdit" in scores:
        kind = _mmdit_kind(adapter)
        # Flux files also have single blocks; an SD3/Flux width fact decides where the shared names count.
        name = kind[0] if kind else ("flux" if "flux" in scores else "sd3-or-flux")
        scores[name] = scores.get(name, 0) + scores.pop("mmdit")
        first.setdefault(name, first.pop("mmdit"))
        folded += _fold_shared(adapter, scores, first)  # owners the width named
    arch = max(scores, key=lambda a: (scores[a], -_order(a)))
    deeper = _deeper(adapter, arch) if arch in BY_DEPTH else None
    if deeper:
        scores[deeper[0]] = scores.get(deeper[0], 0) + scores.pop(arch)
        first.setdefault(deeper[0], first.pop(arch))
        arch = deeper[0]
        folded.append(deeper)
    evidence = [f"{scores[arch]} of {len(adapter.parts)} parts match {arch} names, e.g. {first[arch]}"]
    if arch in (*MMDIT_BY_WIDTH.values(), "sd3-or-flux") and (kind := _mmdit_kind(adapter)):
        evidence.append(kind[1])
    evidence += [why for owner, why in folded if owner == arch]
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
