"""Split a file key into (layout, component, module path, family, role): pure string work, no tensors."""

from __future__ import annotations

import re
from dataclasses import dataclass

DENOISER = "denoiser"
# Pipeline component names. MiniMax-H3 pipelines hold a second denoiser partition, `transformer_ref` (ref2va).
DENOISER_NAMES = ("transformer", "unet", "denoiser", "prior", "transformer_2", "transformer_ref")
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
COMPONENT_NAMES = (
    *DENOISER_NAMES,
    *TEXT_ENCODER_NAMES,
    "connectors",
    "text_conditioner",
)

# (prefix, component, layout). Longest match wins; order here only matters for equal-length prefixes.
_PREFIXES: tuple[tuple[str, str, str], ...] = (
    ("lora_unet_", DENOISER, "kohya"),
    ("oft_unet_", DENOISER, "kohya"),
    ("lora_te1_", "text_encoder", "kohya"),
    ("lora_te2_", "text_encoder_2", "kohya"),
    ("lora_te3_", "text_encoder_3", "kohya"),
    ("lora_te_", "text_encoder", "kohya"),
    ("lora_transformer_", DENOISER, "onetrainer"),
    ("lycoris_", DENOISER, "lycoris"),
    ("model.diffusion_model.", DENOISER, "comfyui"),
    ("diffusion_model.", DENOISER, "comfyui"),
    ("text_encoders.clip_l.transformer.", "text_encoder", "comfyui"),
    ("text_encoders.clip_g.transformer.", "text_encoder_2", "comfyui"),
    ("unet.", DENOISER, "diffusers"),
    ("transformer.", DENOISER, "diffusers"),
    ("transformer_ref.", "transformer_ref", "diffusers"),  # MiniMax-H3's second partition
    ("text_encoder.", "text_encoder", "diffusers"),
    ("text_encoder_2.", "text_encoder_2", "diffusers"),
    ("text_encoder_3.", "text_encoder_3", "diffusers"),
    ("connectors.", "connectors", "diffusers"),  # LTX-2 text connectors
    ("text_embedding_projection.", "connectors", "comfyui"),  # LTX-2 original name of the connectors
    # SimpleTuner's ComfyUI export of LTX-2 (SimpleTuner #2349): the connectors' diffusers names behind the
    # denoiser's prefix; and the original projection there.
    ("diffusion_model.connectors.", "connectors", "comfyui"),
    ("diffusion_model.text_embedding_projection.", "connectors", "comfyui"),
    # Anima: the DiT's `llm_adapter` is the pipeline's `text_conditioner` (same module names below the
    # prefix).
    ("text_conditioner.", "text_conditioner", "diffusers"),
    ("diffusion_model.llm_adapter.", "text_conditioner", "comfyui"),
    ("lora_unet_llm_adapter_", "text_conditioner", "kohya"),
    (
        "text_encoder.qwen3.",
        "text_encoder",
        "comfyui",
    ),  # sd-scripts' convert_anima_lora_to_comfy: the Qwen3 encoder
)
_PREFIXES_BY_LENGTH = sorted(_PREFIXES, key=lambda p: -len(p[0]))


def component_prefix(component: str, layout: str) -> str | None:
    """The key prefix `layout` (kohya, comfyui, ...) writes for a pipeline component (first listed), or
    None."""
    return next((p for p, comp, hint in _PREFIXES if comp == component and hint == layout), None)


# (suffix regex, family, role, layout hint). The first match wins, so longer/more specific come first.
# role None: the suffix itself names the role (`hada_w1_a`, `lokr_w2`, `oft_blocks`, `a1`, `on_input`, ...).
# Families other than "lora" and "full" are recognised here and reported as unsupported by the planner.
_SUFFIXES: tuple[tuple[str, str, str | None, str | None], ...] = (
    (r"\.lora_down\.weight", "lora", "down", None),
    (r"\.lora_up\.weight", "lora", "up", None),
    (r"\.lora_mid\.weight", "lora", "mid", None),
    (r"\.lora_A(?:\.[^.]+)?\.weight", "lora", "down", "peft"),
    (r"\.lora_B(?:\.[^.]+)?\.weight", "lora", "up", "peft"),
    (r"\.lora_B(?:\.[^.]+)?\.bias", "lora", "up_bias", "peft"),
    (r"\.lora_A", "lora", "down", "peft"),
    (r"\.lora_B", "lora", "up", "peft"),
    (r"\.lora_linear_layer\.down\.weight", "lora", "down", "lora_linear_layer"),
    (r"\.lora_linear_layer\.up\.weight", "lora", "up", "lora_linear_layer"),
    (r"\.lora\.down\.weight", "lora", "down", "diffusers_lora_layer"),
    (r"\.lora\.up\.weight", "lora", "up", "diffusers_lora_layer"),
    # Old diffusers files write the role after an underscore (`to_q_lora.down.weight`); ComfyUI reads it.
    (r"_lora\.down\.weight", "lora", "down", "diffusers_lora_suffix"),
    (r"_lora\.up\.weight", "lora", "up", "diffusers_lora_suffix"),
    (r"\.alpha", "lora", "alpha", None),
    (r"\.scale", "lora", "scale", None),
    (r"\.diff", "full", "diff", None),
    (r"\.diff_b", "full", "diff_b", None),
    (r"\.diff_m", "full", "diff_m", None),  # lightx2v Wan: delta of the module's `modulation` parameter
    (r"\.dora_scale", "dora", "dora_scale", None),
    (r"\.lora_magnitude_vector(?:\.[^.]+)?(?:\.weight)?", "dora", "dora_scale", "peft"),
    # ai-toolkit's DoRA magnitude (InvokeAI #9517, #9558): PEFT's vector under a bare `.magnitude`.
    (r"\.magnitude", "dora", "dora_scale", None),
    (r"\.hada_(?:w[12]_[ab]|t[12])", "loha", None, None),
    (r"\.lokr_(?:w[12](?:_[ab])?|t2)", "lokr", None, None),
    (r"\.oft_(?:blocks(?:\.\d+)?|diag)", "oft", None, None),  # kohya Flux OFT: oft_blocks.<split>
    (r"\.oft_R\.weight", "oft", None, "peft"),
    (r"\.boft_[RsS]", "boft", None, "peft"),
    (r"\.rescale", "oft", "rescale", None),
    (r"\.(?:a1|a2|b1|b2)\.weight", "glora", None, None),
    (r"\.(?:ia3_l|on_input)", "ia3", None, None),
    (r"\.(?:w_norm|b_norm)", "norm", None, None),
    (r"\.set_weight", "set", None, None),
    (
        r"\.reshape_weight",
        "lora",
        "reshape",
        None,
    ),  # BFL control LoRAs: the (out, in) the module must grow to
    (r"\.bias_(?:indices|values|size)", "sparse_bias", None, None),
    (r"\.(?:q_layer|p_layer|lambda_layer)", "tlora", None, None),
)
_SUFFIX_RE = [
    (re.compile(rf"^(?P<stem>.+?)(?P<suffix>{rx})$"), fam, role, hint) for rx, fam, role, hint in _SUFFIXES
]

# Old diffusers attention processors: `attn1.processor.to_out_lora.down.weight` names the module
# `attn1.to_out.0`.
_PROCESSOR_RE = re.compile(
    r"^(?P<stem>.+)\.processor\.(?P<proj>to_q|to_k|to_v|to_out)_lora\.(?P<role>down|up)\.weight$"
)
# The same processor names with any other LoRA suffix (ComfyUI's SD key map reads `<...>.processor.to_q`).
_PROCESSOR_STEM_RE = re.compile(r"^(?P<stem>.+)\.processor\.(?P<proj>to_q|to_k|to_v|to_out)$")
# XLabs Flux: attention-processor LoRAs named by block; lora1 is the image stream, lora2 the text stream
# (diffusers' `_convert_xlabs_flux_lora_to_diffusers`). The stem becomes the BFL module name the Flux table
# knows.
_XLABS_RE = re.compile(
    r"^(?P<block>(?:.*\.)?(?P<kind>double|single)_blocks\.\d+)\.processor\."
    r"(?P<proj>qkv|proj)_lora(?P<n>[12]?)\.(?P<role>down|up)\.weight$"
)
_XLABS_NAMES = {
    ("double", "qkv", "1"): "img_attn.qkv",
    ("double", "qkv", "2"): "txt_attn.qkv",
    ("double", "proj", "1"): "img_attn.proj",
    ("double", "proj", "2"): "txt_attn.proj",
    ("single", "qkv", ""): "linear1_qkv",
    ("single", "proj", ""): "linear2",
}
# Wan Stand-In (WeChatCV): identity LoRAs on self-attention q/k/v, `blocks.N.self_attn.q_loras.down.weight`.
_STANDIN_RE = re.compile(r"^(?P<stem>.+\.self_attn\.[qkv])_loras\.(?P<role>down|up)\.weight$")
# cloneofsimo lora_diffusion: `unet:<i>:down`, i = enumeration order of the trainer's injected Linear layers.
_CLONEOFSIMO_RE = re.compile(r"^(?P<stem>(?:unet|text_encoder):\d+):(?P<role>down|up)$")
CLONEOFSIMO_STEM_RE = re.compile(r"^(?P<component>unet|text_encoder):(?P<index>\d+)$")


@dataclass(frozen=True)
class ParsedKey:
    key: str
    stem: str  # everything before the family suffix: identifies one target module group
    family: str
    role: str
    layout_hint: str | None


# The unparsed reason of a token embedding (cloneofsimo pivotal tuning: `<s1>`, `<s2>`, one [768] vector
# each).
TEXTUAL_INVERSION = "textual-inversion token embedding, not an adapter weight"


def parse_key(key: str) -> ParsedKey | str:
    """Return the parsed key, or a reason string when no layout we know produces this key."""
    m = _CLONEOFSIMO_RE.match(key)
    if m:
        return ParsedKey(key, m["stem"], "lora", m["role"], "cloneofsimo")
    m = _STANDIN_RE.match(key)
    if m:
        return ParsedKey(key, m["stem"], "standin", m["role"], "stand-in")
    m = _XLABS_RE.match(key)
    if m and (m["kind"], m["proj"], m["n"]) in _XLABS_NAMES:
        return ParsedKey(
            key, f"{m['block']}.{_XLABS_NAMES[m['kind'], m['proj'], m['n']]}", "lora", m["role"], "xlabs"
        )
    m = _PROCESSOR_RE.match(key)
    if m:
        proj = "to_out.0" if m["proj"] == "to_out" else m["proj"]
        return ParsedKey(key, f"{m['stem']}.{proj}", "lora", m["role"], "diffusers_attn_processor")
    # IA3's `.weight` collides with plain module weights; it is recognised only through its `.on_input`
    # sibling.
    for rx, family, role, hint in _SUFFIX_RE:
        m = rx.match(key)
        if m:
            stem = m["stem"]
            if (processor := _PROCESSOR_STEM_RE.match(stem)) is not None:
                proj = "to_out.0" if processor["proj"] == "to_out" else processor["proj"]
                stem = f"{processor['stem']}.{proj}"
            return ParsedKey(key, stem, family, role or m["suffix"][1:].removesuffix(".weight"), hint)
    if "<" in key and ">" in key:
        return TEXTUAL_INVERSION
    return "no known adapter suffix (not a LoRA/LyCORIS key)"


@dataclass(frozen=True)
class StemTarget:
    component: str
    path: str  # module path as written in the file (dotted or underscored), prefix removed
    layout: str
    explicit_component: bool  # False when no prefix said which component the key is for


def split_stem(stem: str) -> StemTarget:
    """Remove PEFT wrappers and the component prefix from a stem."""
    m = CLONEOFSIMO_STEM_RE.match(stem)
    if m:
        component = DENOISER if m["component"] == "unet" else "text_encoder"
        return StemTarget(component, stem, "cloneofsimo", True)
    stem = stem.replace("base_model.model.", "", 1) if "base_model.model." in stem else stem
    # ComfyUI's PEFT form names the parameter: `<module>.weight.lora_B.default.weight`.
    stem = stem.removesuffix(".weight")
    for prefix, component, layout in _PREFIXES_BY_LENGTH:
        if stem.startswith(prefix):
            return StemTarget(component, stem[len(prefix) :], layout, True)
    return StemTarget(DENOISER, stem, "bare", False)


def peft_magnitude(key: str) -> bool:
    """Whether a DoRA magnitude key follows PEFT's convention (output axis, strength inside the norm):
    PEFT's `lora_magnitude_vector` and ai-toolkit's `.magnitude`; else LyCORIS's `dora_scale`."""
    return "lora_magnitude_vector" in key or key.endswith(".magnitude")


def underscore_form(path: str) -> str:
    """Normalise a module path for alias lookup: kohya writes `.` as `_`; trainers add stray `_`."""
    return re.sub(r"_+", "_", path.replace(".", "_")).strip("_")
