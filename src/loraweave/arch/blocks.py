"""Block slots per architecture (declarative tables) and block weights: scalar, vector, dict or preset.

UNets use the A1111 "LoRA Block Weight" (LBW) slot names over the original-SD block order: BASE (text
encoders and every non-block layer), IN00.., M00, OUT00.. — 26 slots for SD1/SD2 (4 down blocks), 20 for
SDXL (3 down blocks). The LBW short layouts are accepted as vectors: 17 values for SD1, 12 for SDXL (the
attention-bearing blocks); the slots they leave out get 1, as LBW expands them. DiTs: BASE + one slot per
block of each layer chain (Flux/Chroma D00.. double + S00.. single, Z-Image J00.., SD3/Wan/Qwen-Image B00..).

Presets are the LBW names. On UNets they are groups of blocks (shallow/deep inputs, middle, deep/shallow
outputs) whose restriction to the 17-slot layout is exactly the published LBW vectors; on DiTs the published
17-slot vector is stretched over the model's blocks in execution order."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ArgumentError
from . import registry

# The tables are each architecture's `blocks` facet (arch/record.BlockMap), read from the registry on each
# call.


def _unet_archs() -> dict[str, tuple[int, tuple[str, ...], tuple[int, int]]]:
    """Block arch -> (down blocks = up blocks, LBW short layout, preset splits), for UNets. Every supported
    UNet has 2 layers per down block (3 per up block), so input index = 1 + 3·block + layer, output = 3·block
    + layer."""
    return {a.blocks.key: a.blocks.unet for a in registry.ARCHITECTURES if a.blocks and a.blocks.unet}


def _dit_archs() -> dict[str, tuple[tuple[str, str, int], ...]]:
    """Block arch -> ((slot prefix, module chain, default length), ...) in execution order, for DiTs."""
    return {a.blocks.key: a.blocks.chains for a in registry.ARCHITECTURES if a.blocks and a.blocks.chains}


def _class_arch() -> dict[str, str]:
    """diffusers class name -> block arch, for DiTs (UNet2DConditionModel is told apart by its config)."""
    return {
        a.skeleton.cls: a.blocks.key
        for a in registry.ARCHITECTURES
        if a.blocks and a.blocks.chains and a.skeleton
    }


def block_arch_of(arch: str) -> str | None:
    """The block arch of a registered architecture (its record's block map), or None when it has none."""
    record = registry.by_name().get(arch)
    return record.blocks.key if record is not None and record.blocks else None


def unet_layout(arch: str) -> tuple[str, ...]:
    """The A1111 LBW short layout of a UNet block arch."""
    return _unet_archs()[arch][1]


# The published LBW presets over the 17-slot SD1 layout (sd-webui-lora-block-weight defaults).
LBW_PRESETS_17: dict[str, tuple[float, ...]] = {
    "NONE": (0,) * 17,
    "ALL": (1,) * 17,
    "INS": (1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    "IND": (1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    "INALL": (1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    "MIDD": (1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0),
    "OUTD": (1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0),
    "OUTS": (1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1),
    "OUTALL": (1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1),
    "ALL0.5": (0.5,) * 17,
}
# Which block groups each preset turns on (value 1, or 0.5 for ALL0.5), for UNets.
_PRESET_GROUPS: dict[str, tuple[str, ...]] = {
    "NONE": (),
    "ALL": ("base", "in_s", "in_d", "mid", "out_d", "out_s"),
    "INS": ("base", "in_s"),
    "IND": ("base", "in_d"),
    "INALL": ("base", "in_s", "in_d"),
    "MIDD": ("base", "in_d", "mid", "out_d"),
    "OUTD": ("base", "out_d"),
    "OUTS": ("base", "out_s"),
    "OUTALL": ("base", "out_d", "out_s"),
    "ALL0.5": ("base", "in_s", "in_d", "mid", "out_d", "out_s"),
}
# Two-chain DiTs only: keep one chain, mute the other.
_CHAIN_PRESETS = {"DOUBLE": "D", "SINGLE": "S"}


def preset_names() -> tuple[str, ...]:
    """Every preset name `block_weights` takes: the LBW presets (every architecture), then the chain presets
    (double/single-stream DiTs only)."""
    return (*LBW_PRESETS_17, *_CHAIN_PRESETS)


_COMPONENT_PREFIXES = ("unet.", "transformer.")
_TEXT_ENCODER = re.compile(r"^(text_encoder(_\d)?|te\d?|lora_te\d?)[._]")
_UNET_IN = re.compile(r"^down_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)(\.|$)")
_UNET_OUT = re.compile(r"^up_blocks\.(\d+)\.(resnets|attentions|upsamplers)\.(\d+)(\.|$)")


def _check_arch(arch: str) -> None:
    unets, dits = _unet_archs(), _dit_archs()
    if arch not in unets and arch not in dits:
        raise ArgumentError(f"unknown block arch {arch!r}; known: {', '.join([*unets, *dits])}")


def _chain_lengths(arch: str, chains: Mapping[str, int] | None) -> list[tuple[str, str, int]]:
    table = _dit_archs()[arch]
    if chains is None:
        return list(table)
    unknown = set(chains) - {name for _, name, _ in table}
    if unknown:
        raise ArgumentError(
            f"{arch} has no layer chain {sorted(unknown)}; chains: {[n for _, n, _ in table]}"
        )
    return [(prefix, name, int(chains.get(name, 0))) for prefix, name, _ in table]


def _fmt(prefix: str, index: int, length: int) -> str:
    return f"{prefix}{index:0{max(2, len(str(length - 1)))}d}"


def slot_names(arch: str, chains: Mapping[str, int] | None = None) -> list[str]:
    """Every slot of `arch` in order, BASE first; DiT chain lengths default to the reference model's."""
    _check_arch(arch)
    if arch in _unet_archs():
        n = 3 * _unet_archs()[arch][0]
        return ["BASE", *(f"IN{i:02d}" for i in range(n)), "M00", *(f"OUT{i:02d}" for i in range(n))]
    out = ["BASE"]
    for prefix, _, length in _chain_lengths(arch, chains):
        out.extend(_fmt(prefix, i, length) for i in range(length))
    return out


def chain_lengths(arch: str, module_paths: Iterable[str]) -> dict[str, int]:
    """Length of each DiT layer chain seen in `module_paths` (highest block index + 1); {} for UNets."""
    _check_arch(arch)
    if arch in _unet_archs():
        return {}
    out: dict[str, int] = {}
    chains = _dit_archs()[arch]
    for path in module_paths:
        path = _strip_component(path)
        for _, name, _ in chains:
            m = re.match(rf"^{re.escape(name)}\.(\d+)(\.|$)", path)
            if m:
                out[name] = max(out.get(name, 0), int(m.group(1)) + 1)
    return out


def _strip_component(path: str) -> str:
    for prefix in _COMPONENT_PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix) :]
    return path


def _unet_slot(arch: str, path: str) -> str:
    n_blocks = _unet_archs()[arch][0]
    if path == "conv_in" or path.startswith("conv_in."):
        return "IN00"
    if path.startswith("mid_block.") or path == "mid_block":
        return "M00"
    for regex, side in ((_UNET_IN, "IN"), (_UNET_OUT, "OUT")):
        m = regex.match(path)
        if not m:
            continue
        block, kind, layer = int(m.group(1)), m.group(2), int(m.group(3))
        if block >= n_blocks:
            raise ArgumentError(f"{path!r}: {arch} UNets have {n_blocks} {side.lower()} blocks; wrong arch?")
        if side == "IN":
            index = 3 * (block + 1) if kind == "downsamplers" else 1 + 3 * block + layer
        else:
            index = 3 * block + 2 if kind == "upsamplers" else 3 * block + layer
        if layer > 2 or (side == "IN" and kind != "downsamplers" and layer > 1):
            raise ArgumentError(f"{path!r}: layer {layer} does not fit the {arch} block layout")
        return f"{side}{index:02d}"
    return "BASE"


def block_slots(arch: str, module_paths: Iterable[str]) -> dict[str, str | None]:
    """Map each denoiser module path (diffusers names, optionally prefixed `unet.`/`transformer.`) to its
    slot.

    Text-encoder paths map to None: the caller weights them as a component. Denoiser layers outside every
    block (embedders, final norms/projections) map to BASE."""
    _check_arch(arch)
    unet, chains = arch in _unet_archs(), _dit_archs().get(arch, ())
    paths = list(module_paths)
    out: dict[str, str | None] = {}
    lengths = chain_lengths(arch, paths) if chains else {}
    for path in paths:
        if _TEXT_ENCODER.match(path):
            out[path] = None
            continue
        bare = _strip_component(path)
        if unet:
            out[path] = _unet_slot(arch, bare)
            continue
        out[path] = "BASE"
        for prefix, name, _ in chains:
            m = re.match(rf"^{re.escape(name)}\.(\d+)(\.|$)", bare)
            if m:
                out[path] = _fmt(prefix, int(m.group(1)), lengths[name])
                break
    return out


def _unet_group(arch: str, slot: str) -> str:
    last_shallow_in, first_shallow_out = _unet_archs()[arch][2]
    if slot == "BASE":
        return "base"
    if slot == "M00":
        return "mid"
    if slot.startswith("IN"):
        return "in_s" if int(slot[2:]) <= last_shallow_in else "in_d"
    return "out_d" if int(slot[3:]) < first_shallow_out else "out_s"


def _preset(arch: str, name: str, slots: list[str]) -> dict[str, float]:
    if name in _CHAIN_PRESETS:
        if len(_dit_archs().get(arch, ())) != 2:
            raise ArgumentError(f"preset {name} mutes a chain of a double/single-stream DiT; {arch} has none")
        keep = _CHAIN_PRESETS[name]
        return {s: 1.0 if s == "BASE" or s.startswith(keep) else 0.0 for s in slots}
    level = 0.5 if name == "ALL0.5" else 1.0
    if arch in _unet_archs():
        groups = _PRESET_GROUPS[name]
        return {s: level if _unet_group(arch, s) in groups else 0.0 for s in slots}
    return _stretch(LBW_PRESETS_17[name], slots)


def _stretch(vector17: Sequence[float], slots: list[str]) -> dict[str, float]:
    """BASE from entry 0; the 16 block entries resampled (nearest, by position) over the DiT's blocks."""
    blocks = slots[1:]
    out = {"BASE": float(vector17[0])}
    for k, slot in enumerate(blocks):
        out[slot] = float(vector17[1 + (k * 16) // len(blocks)])
    return out


def _numbers(values: Sequence[Any], what: str) -> list[float]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise ArgumentError(f"{what}: every block_weights entry must be a finite number, got {v!r}")
        out.append(float(v))
    return out


def _fits(arch: str, slots: list[str]) -> str:
    n = len(slots)
    forms = [f"a number; a list of {n} values (BASE first) or {n - 1} (BASE = 1)"]
    if arch in _unet_archs():
        forms.append(
            f"the A1111 LBW {len(_unet_archs()[arch][1])}-value layout ({', '.join(_unet_archs()[arch][1])})"
        )
    else:
        forms.append("a 17-value A1111 LBW vector (stretched over the blocks)")
    presets = list(LBW_PRESETS_17) + (list(_CHAIN_PRESETS) if len(_dit_archs().get(arch, ())) == 2 else [])
    forms.append(f"a preset ({', '.join(presets)})")
    forms.append(f"a dict of slot names ({slots[0]}, {slots[1]}, ..., {slots[-1]}; missing slots = 1)")
    return "; ".join(forms)


def block_weights(
    arch: str, value: Any, n_slots: int | None = None, *, chains: Mapping[str, int] | None = None
) -> dict[str, float]:
    """Block weight per slot of `arch` (every slot present) from a scalar, vector, dict, preset or "1,0,..."
    text.

    `chains` gives DiT chain lengths (see `chain_lengths`); for one-chain DiTs `n_slots` may give it instead.
    A value that fits no accepted form raises ValueError listing the forms that would fit."""
    slots = _slots_for(arch, n_slots, chains)
    if isinstance(value, str):
        text = value.strip()
        if text.upper() in LBW_PRESETS_17 or text.upper() in _CHAIN_PRESETS:
            return _preset(arch, text.upper(), slots)
        value = _number_text(arch, value, slots)
    if isinstance(value, Mapping):
        return _from_mapping(arch, value, slots)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {s: v for s, v in zip(slots, _numbers([value] * len(slots), arch), strict=True)}
    if isinstance(value, Sequence) or hasattr(value, "tolist"):
        return _from_vector(arch, list(value.tolist() if hasattr(value, "tolist") else value), slots)
    raise ArgumentError(
        f"block_weights for {arch}: cannot use {type(value).__name__}; accepted: {_fits(arch, slots)}"
    )


def _slots_for(arch: str, n_slots: int | None, chains: Mapping[str, int] | None) -> list[str]:
    """The slot names block weights fill; a one-chain DiT's length may come from `n_slots`."""
    _check_arch(arch)
    dit = _dit_archs().get(arch)
    if n_slots is not None and chains is None and dit is not None and len(dit) == 1:
        chains = {dit[0][1]: int(n_slots) - 1}
    slots = slot_names(arch, chains)
    if n_slots is not None and n_slots != len(slots):
        raise ArgumentError(f"{arch} has {len(slots)} block slots here, n_slots={n_slots} given")
    return slots


def _number_text(arch: str, value: str, slots: list[str]) -> list[float]:
    """ "1,0,0.5": the numbers of a comma list."""
    try:
        return [float(x) for x in value.strip().split(",")]
    except ValueError:
        raise ArgumentError(
            f"block_weights {value!r} for {arch}: not a preset or number list; accepted: {_fits(arch, slots)}"
        ) from None


def _from_mapping(arch: str, value: Mapping, slots: list[str]) -> dict[str, float]:
    """{slot: weight}: named slots, the others at 1."""
    unknown = [k for k in value if k not in slots]
    if unknown:
        raise ArgumentError(
            f"block_weights for {arch}: unknown slots {unknown}; accepted: {_fits(arch, slots)}"
        )
    given = dict(zip(value.keys(), _numbers(list(value.values()), arch), strict=True))
    return {s: given.get(s, 1.0) for s in slots}


def _from_vector(arch: str, raw: list, slots: list[str]) -> dict[str, float]:
    """A vector: every slot, every slot but BASE, a UNet's short LBW layout, or 17 values stretched over a
    DiT."""
    values = _numbers(raw, arch)
    if len(values) == len(slots):
        return dict(zip(slots, values, strict=True))
    if len(values) == len(slots) - 1:
        return {"BASE": 1.0, **dict(zip(slots[1:], values, strict=True))}
    unet = _unet_archs().get(arch)
    if unet is not None and len(values) == len(unet[1]):
        short = dict(zip(unet[1], values, strict=True))
        return {s: short.get(s, 1.0) for s in slots}
    if arch in _dit_archs() and len(values) == 17:
        return _stretch(values, slots)
    raise ArgumentError(
        f"block_weights for {arch}: {len(values)} values fit no layout; accepted: {_fits(arch, slots)}"
    )


def weights_for_modules(
    arch: str, module_paths: Iterable[str], value: Any, *, chains: Mapping[str, int] | None = None
) -> dict[str, float | None]:
    """Block weight of each module path (None for text-encoder paths, which take BASE via the caller).

    Pass `chains` measured on the whole model (`chain_lengths(arch, names of model.named_modules())`): the
    paths one adapter touches may miss the last blocks, and presets stretch over the model's block count."""
    paths = list(module_paths)
    weights = block_weights(arch, value, chains=chains)
    slots = block_slots(arch, paths)
    missing = sorted({s for s in slots.values() if s is not None and s not in weights})
    if missing:
        raise ArgumentError(
            f"module paths reach slots {missing[:5]} beyond the {arch} layout given by chains={chains}"
        )
    return {p: (None if slot is None else weights[slot]) for p, slot in slots.items()}


def detect_block_arch(model: Any) -> str:
    """Block arch of a diffusers denoiser (or a pipeline holding one as `.unet` / `.transformer`)."""
    for attr in ("unet", "transformer"):
        inner = getattr(model, attr, None)
        if inner is not None and not isinstance(model, type(inner)):
            model = inner
            break
    name = type(model).__name__
    if name in _class_arch():
        return _class_arch()[name]
    if name == "UNet2DConditionModel":
        cfg = model.config
        layers = cfg.layers_per_block
        if any(v != 2 for v in (layers if isinstance(layers, (list, tuple)) else [layers])):
            raise ArgumentError(f"UNet with layers_per_block={layers}: block slots are defined for 2 only")
        n_down = len(cfg.down_block_types)
        for arch, (blocks, _, _) in _unet_archs().items():
            if blocks == n_down and len(cfg.up_block_types) == blocks:
                return arch
        raise ArgumentError(f"UNet with {n_down} down blocks has no block-slot layout (SD1/SD2: 4, SDXL: 3)")
    known = ", ".join(["UNet2DConditionModel", *_class_arch()])
    raise ArgumentError(f"no block-slot table for {name}; known: {known}")
