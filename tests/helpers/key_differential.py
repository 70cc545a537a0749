"""The differential against ComfyUI's newest key maps (tests/test_comfy_key_differential.py): on each tiny
ComfyUI model (helpers.comfy_arch_cases, helpers.comfy_models), ComfyUI's own `model_lora_keys_unet` /
`model_lora_keys_clip` (comfy/lora.py) on the real module tree give every key prefix it lands and where (a
weight, and for a fused key its rows); a LoRA file per layout (prefix family) over every such prefix then goes
through loraweave's ComfyUI planner (`plan_for_patcher` / `plan_for_clip`, nothing is written), and each key
must land on the same weight and rows. Misses that stay are named here with their reason (NAMED_MISSES) and
printed in docs/support-matrix.md (`table_lines`, written by scripts/support_matrix.py)."""

from __future__ import annotations

import collections
import re
import textwrap
from dataclasses import dataclass, field

import torch

# Key prefixes of the layouts ComfyUI's maps write, longest first; a prefix none of these starts is "bare".
PREFIXES = (
    "unet.base_model.model.",
    "base_model.model.",
    "lora_transformer_",
    "lora_prior_unet_",
    "diffusion_model.",
    "text_encoders.",
    "text_encoder_2.",
    "text_encoder.",
    "transformer.",
    "lora_prior_te_",
    "lora_unet_",
    "lycoris_",
    "lora_te1_",
    "lora_te2_",
    "lora_te3_",
    "lora_te_",
    "unet.",
)
# The LoRA spellings ComfyUI's LoRAAdapter.load reads after a prefix (up, down), in its order.
SUFFIXES = (
    (".lora_up.weight", ".lora_down.weight"),
    ("_lora.up.weight", "_lora.down.weight"),
    (".lora_B.weight", ".lora_A.weight"),
    (".lora.up.weight", ".lora.down.weight"),
    (".lora_B", ".lora_A"),
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    (".lora_B.default.weight", ".lora_A.default.weight"),
)
# Cases whose every layout is checked in every spelling (the others in the first, kohya's).
EVERY_SPELLING = ("sd15", "flux")
# ComfyUI CLIPs checked with `model_lora_keys_clip` (tiny_clip kinds) and the case that carries each.
CLIPS = {"sd15": "sd1", "sdxl": "sdxl", "flux": "flux"}

Where = tuple[str, int, int]  # (weight key without `.weight`, first row, rows)


@dataclass(frozen=True)
class NamedMiss:
    pattern: str  # regex over the file key prefix
    why: str


# Keys ComfyUI lands that loraweave does not, by case: each with its reason (also in the support matrix).
_FLUX_ON_FLUX2 = NamedMiss(
    r"(transformer\.|lycoris_|lora_transformer_)?(transformer_blocks_?\.?\d+.?ff(_context)?.?net"
    r"|single_transformer_blocks_?\.?\d+.?(attn.?to_[qkv]|proj_mlp|proj_out)|time_text_embed).*",
    "Flux.1's diffusers names on a Flux.2 model: ComfyUI's one Flux key map (comfy.utils.flux_to_diffusers) "
    "serves both; Flux.2 files use Flux.2's names (ff.linear_in, attn.to_qkv_mlp_proj), which land",
)
_FLUX2_ON_FLUX = NamedMiss(
    r".*(ff(_context)?.?linear_(in|out)|attn.?to_qkv_mlp_proj|single_transformer_blocks.?\d+.?attn.?to_out)$",
    "Flux.2's diffusers names on a Flux.1 model (the same shared map, the other way round)",
)
NAMED_MISSES: dict[str, tuple[NamedMiss, ...]] = {
    "flux2": (
        _FLUX_ON_FLUX2,
        NamedMiss(
            r"diffusion_model\.single_blocks\.\d+\.linear1_qkv",
            "USO's single-block `linear1_qkv` (Flux.1's q, k, v rows of linear1) on Flux.2: USO is a Flux.1 "
            "LoRA; Flux.2's fused `to_qkv_mlp_proj` has no table row range for it",
        ),
    ),
    "flux": (_FLUX2_ON_FLUX,),
    "chroma": (_FLUX2_ON_FLUX,),
    "lumina2": (
        NamedMiss(
            r".*(attention.?to_(q|k|v|out.?0)|all_final_layer.?2-1.*|all_x_embedder.?2-1)$",
            "Z-Image's diffusers names on a Lumina 2 model: ComfyUI's one NextDiT map "
            "(comfy.utils.z_image_to_diffusers) serves both; they are another architecture's file",
        ),
    ),
    "sdxl": (
        NamedMiss(
            r"(lora_unet_|lycoris_|unet\.)?class_embedding.?linear_[12]",
            "diffusers' name of unCLIP's class embedding on SDXL, whose diffusers name is add_embedding "
            "(lands); no SDXL file spells it so",
        ),
    ),
    "ace-step": (
        NamedMiss(
            r"(base_model\.model\.|lycoris_).*",
            "ACE-Step 1.5's official (`base_model.model.`) and LyCORIS names, which ComfyUI maps under its "
            "model's `decoder.`: the pack has no ComfyUI facets for ACE-Step yet (issue 41 item 2's class)",
        ),
    ),
    "sdxl-clip": (
        NamedMiss(
            r"lora_prior_te_text_projection",
            "Stable Cascade's prior text-projection key on clip_g (no Stable Cascade architecture)",
        ),
    ),
    "flux-clip": (
        NamedMiss(
            r"text_encoders\.(t5xxl\.)?transformer\..*",
            "ComfyUI's generic `text_encoders.` spelling of T5 (its LoRA extract node writes it): the "
            "encoder's component depends on the model (Flux's 2nd, SD3's 3rd); clip_l / clip_g land",
        ),
    ),
}


@dataclass
class LayoutResult:
    case: str
    layout: str
    comfy: int  # keys ComfyUI's map lands
    ours: int  # of those, keys loraweave lands on the same weight and rows
    missed: list[str] = field(default_factory=list)
    wrong: list[tuple[str, list[Where], list[Where]]] = field(default_factory=list)
    spellings: int = 1
    model_class: str = ""  # ComfyUI's supported_models class


def layout_of(prefix: str) -> str:
    return next((p for p in PREFIXES if prefix.startswith(p)), "bare")


def _grouped(key_map: dict, state: dict[str, torch.Tensor], strip: str) -> dict[str, dict[str, tuple]]:
    """{layout: {file prefix: (weight, first row, rows, input width)}} of the 2-D weights the map names."""
    out: dict[str, dict[str, tuple]] = collections.defaultdict(dict)
    for prefix, value in key_map.items():
        value = value if isinstance(value, tuple) else (value,)
        weight, rows = value[0], (value[1] if len(value) > 1 else None)
        if len(value) > 2 and value[2] is not None:
            continue  # a row function (SD3's swap_scale_shift): reorders rows, no plain landing to compare
        if not weight.endswith(".weight") or weight not in state or state[weight].ndim != 2:
            continue  # a weight this model lacks never lands; 1-D weights take no LoRA
        out_rows, width = state[weight].shape
        start, count = (rows[1], rows[2]) if rows else (0, out_rows)
        out[layout_of(prefix)][prefix] = (
            weight.removeprefix(strip).removesuffix(".weight"),
            start,
            count,
            width,
        )
    return out


def _lora_file(entries: dict[str, tuple], up: str, down: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for prefix, (_, _, rows, width) in entries.items():
        sd[prefix + down] = torch.randn(2, width, generator=g)
        sd[prefix + up] = torch.randn(rows, 2, generator=g)
    return sd


def _landed(plan, prefix_of_component) -> dict[str, list[Where]]:
    """{file key: [(weight, first row, rows)]}, contiguous pieces on one module joined."""
    out: dict[str, list[Where]] = {}
    for pp in plan.planned:
        pieces = sorted(
            (prefix_of_component(pp.component) + p.module, p.dst_start, p.length) for p in pp.pieces
        )
        joined: list[Where] = []
        for module, start, rows in pieces:
            if joined and joined[-1][0] == module and joined[-1][1] + joined[-1][2] == start:
                joined[-1] = (module, joined[-1][1], joined[-1][2] + rows)
            else:
                joined.append((module, start, rows))
        out.update({key: joined for key in pp.part.keys})
    return out


def _compare(case: str, layout: str, entries: dict, landed: dict, up: str) -> LayoutResult:
    result = LayoutResult(case, layout, len(entries), 0)
    for prefix, (weight, start, rows, _) in entries.items():
        got, want = landed.get(prefix + up), [(weight, start, rows)]
        if got is None:
            result.missed.append(prefix)
        elif got != want:
            result.wrong.append((prefix, got, want))
        else:
            result.ours += 1
    return result


def unet_results(case: str, patcher) -> list[LayoutResult]:
    """Every layout of ComfyUI's diffusion-model key map on `patcher`'s real module tree."""
    import comfy.lora

    from loraweave.comfy.api import read_lora
    from loraweave.comfy.targets import plan_for_patcher

    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    groups = _grouped(key_map, patcher.model.state_dict(), "diffusion_model.")
    results = []
    spellings = SUFFIXES if case in EVERY_SPELLING else SUFFIXES[:1]
    for layout, entries in sorted(groups.items()):
        per_spelling = []
        for up, down in spellings:
            plan = plan_for_patcher(patcher, read_lora(_lora_file(entries, up, down)))
            per_spelling.append(_compare(case, layout, entries, _landed(plan, lambda _: ""), up))
        first = per_spelling[0]
        for other in per_spelling[1:]:  # every spelling lands what the first does, nothing else
            first.missed += [k for k in other.missed if k not in first.missed]
            first.wrong += other.wrong
        first.spellings = len(spellings)
        first.model_class = type(patcher.model.model_config).__name__
        results.append(first)
    return results


def clip_results(case: str, clip) -> list[LayoutResult]:
    """Every layout of ComfyUI's text-encoder key map on a ComfyUI CLIP."""
    import comfy.lora

    from loraweave.comfy.api import read_lora
    from loraweave.comfy.targets import plan_for_clip

    key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {})
    groups = _grouped(key_map, clip.cond_stage_model.state_dict(), "")
    up, down = SUFFIXES[0]
    results = []
    for layout, entries in sorted(groups.items()):
        plan = plan_for_clip(clip, read_lora(_lora_file(entries, up, down)))
        landed = _landed(plan, lambda component: f"{component}.")
        results.append(_compare(f"{case}-clip", layout, entries, landed, up))
        results[-1].model_class = type(clip.cond_stage_model).__name__
    return results


def unnamed(result: LayoutResult) -> list[str]:
    """The result's misses no NAMED_MISSES entry of its case explains."""
    named = NAMED_MISSES.get(result.case, ())
    return [k for k in result.missed if not any(re.fullmatch(n.pattern, k) for n in named)]


def named_reasons(results: list[LayoutResult]) -> dict[tuple[str, str], int]:
    """{(case, reason): keys} of the named misses that occur."""
    out: dict[tuple[str, str], int] = collections.Counter()
    for r in results:
        for key in r.missed:
            hit = next((n for n in NAMED_MISSES.get(r.case, ()) if re.fullmatch(n.pattern, key)), None)
            if hit is not None:
                out[r.case, hit.why] += 1
    return out


TABLE_HEADING = "## Keys ComfyUI's newest key maps and diffusers' converters land"
_CONVERTERS = (
    "diffusers 0.42.1's converters (lora_conversion_utils), run on a LoRA over every Linear of the same "
    "ComfyUI model under its original names, one module at a time (`modules`): `diffusers` counts the keys a "
    "converter turns into modules of the case's diffusers twin; `loraweave` those loraweave lands on the "
    "twin on the same rows (row for row, swapped halves included); `loraweave, all`: of all `modules`, the "
    "keys loraweave lands on the twin (a converter refuses some modules alone). Not run: converters that "
    "read a whole file at once (Flux.2, Lumina 2, Z-Image, Anima, Qwen-Image; their layouts are checked in "
    "tests/test_arch_*.py)."
)
_PREAMBLE = (
    "Generated from tests/test_comfy_key_differential.py (ComfyUI 0.33, master of 2026-08-22): on a tiny "
    "ComfyUI model of each class, `comfy.lora.model_lora_keys_unet` / `model_lora_keys_clip` give every key "
    "ComfyUI lands (2-D weights; rows for fused keys); a LoRA over them per layout goes through loraweave's "
    "ComfyUI planner. `loraweave`: keys landing on the same weight and rows; `missed`: keys ComfyUI lands "
    "and loraweave does not, each named below. Cases sd15 and flux run every LoRA spelling ComfyUI reads. "
    "Krea 2, MiniMax-H3, Ideogram 4 and ACE-Step 1.5 (classes of the newest tree only) are built from "
    "ComfyUI's class at tiny widths. Not in it yet: Wan Animate 2 (WAN_Animate2; no tiny build) and "
    "HiDream-O1 (no loraweave architecture: not mapped)."
)


def table_lines(all_: Results) -> list[str]:
    """The support matrix's section: one row per case and layout, the named misses, then diffusers'
    converters."""
    results = all_.comfy
    lines = [
        TABLE_HEADING,
        "",
        *textwrap.wrap(_PREAMBLE, 108),
        "",
        "| case (ComfyUI class) | layout | ComfyUI | loraweave | missed |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        case = f"{r.case} ({r.model_class})"
        lines.append(f"| {case} | `{r.layout}` | {r.comfy} | {r.ours} | {len(r.missed) + len(r.wrong)} |")
    lines += ["", "| case | keys | why loraweave does not land them |", "|---|---|---|"]
    lines += [f"| {case} | {n} | {why} |" for (case, why), n in sorted(named_reasons(results).items())]
    lines += ["", *textwrap.wrap(_CONVERTERS, 108), ""]
    lines += ["| case | converter | modules | diffusers | loraweave | missed | loraweave, all |"]
    lines += ["|---|---|---|---|---|---|---|"]
    for r in all_.diffusers:
        missed = len(r.missed) + len(r.wrong)
        row = f"| {r.case} | `{r.converter}` | {r.modules} | {r.lands} | {r.ours} | {missed} | {r.ours_all} |"
        lines.append(row)
    return lines


# diffusers 0.42.1 converters (diffusers.loaders.lora_conversion_utils), by case: (converter, the layout it
# reads: key stem of an original module name, LoRA spelling). Fed one module's keys at a time (alpha = rank,
# so no scale moves values), each converts the module or raises; what it converts names modules and rows of
# the case's diffusers twin (found by the values of the up rows).
def _kohya(name: str) -> str:
    return "lora_unet_" + name.replace(".", "_")


def _comfy(name: str) -> str:
    return "diffusion_model." + name


_DOWN_UP = (".lora_up.weight", ".lora_down.weight")
_A_B = (".lora_B.weight", ".lora_A.weight")
CONVERTERS = {
    "flux": ("_convert_kohya_flux_lora_to_diffusers", _kohya, _DOWN_UP),
    "hunyuan-video": ("_convert_hunyuan_video_lora_to_diffusers", _comfy, _A_B),
    "wan22-5b": ("_convert_non_diffusers_wan_lora_to_diffusers", _comfy, _A_B),
    "wan": ("_convert_non_diffusers_wan_lora_to_diffusers", _comfy, _A_B),
    "ltx-video": ("_convert_non_diffusers_ltxv_lora_to_diffusers", _comfy, _A_B),
    "ltx2": ("_convert_non_diffusers_ltx2_lora_to_diffusers", _comfy, _A_B),
    "hidream": ("_convert_non_diffusers_hidream_lora_to_diffusers", _comfy, _A_B),
}

Rows = dict[tuple[str, int], int]  # (twin module, its row) -> row of the file's up


@dataclass
class ConverterResult:
    case: str
    converter: str
    modules: int  # modules of ComfyUI's model written in the converter's layout
    lands: int  # keys the converter turns into modules of the twin
    ours: int  # of those, keys loraweave lands on the same twin rows
    ours_all: int = 0  # of the `modules`, keys loraweave lands on the twin
    missed: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)


def _original_file(m, stem_of, up: str, down: str) -> dict[str, dict[str, torch.Tensor]]:
    """{stem: a rank-2 LoRA (alpha 2)} on every 2-D Linear weight of ComfyUI's model, by its original name."""
    originals = getattr(m, "originals", None) or {}
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, mod in m.patcher.model.diffusion_model.named_modules():
        weight = getattr(mod, "weight", None)
        if not isinstance(mod, torch.nn.Linear) or weight is None or weight.ndim != 2:
            continue
        stem = stem_of(originals.get(f"{name}.weight", f"{name}.weight").removesuffix(".weight"))
        rows, width = weight.shape
        out[stem] = {
            stem + down: torch.randn(2, width, generator=g),
            stem + up: torch.randn(rows, 2, generator=g),
            stem + ".alpha": torch.tensor(2.0),
        }
    return out


def _converted_rows(converter, part: dict[str, torch.Tensor], up_key: str, twin: dict) -> Rows | None:
    try:
        out = converter({k: v.clone() for k, v in part.items()})
    except Exception:  # the converter does not take this module alone: it lands nothing here
        return None
    index = {tuple(row.tolist()): i for i, row in enumerate(part[up_key])}
    rows: Rows = {}
    for key, tensor in out.items():
        if not key.endswith("lora_B.weight"):
            continue
        module = key.removeprefix("transformer.").removesuffix(".lora_B.weight")
        if getattr(twin.get(module), "weight", None) is None:
            return None
        for j, row in enumerate(tensor):
            if (i := index.get(tuple(row.tolist()))) is None:
                return None
            rows[module, j] = i
    return rows or None


def converter_result(case: str, m) -> ConverterResult:
    """diffusers' converter for the case, module by module, against loraweave on the diffusers twin."""
    from diffusers.loaders import lora_conversion_utils

    from loraweave.engine.install import resolve_set

    name, stem_of, (up, down) = CONVERTERS[case]
    converter = getattr(lora_conversion_utils, name)
    twin = dict(m.diffusers.named_modules())
    parts = _original_file(m, stem_of, up, down)
    theirs = {s: r for s, p in parts.items() if (r := _converted_rows(converter, p, s + up, twin))}
    plan, _ = resolve_set(m.diffusers, {k: v for p in parts.values() for k, v in p.items()}, 1.0)
    ours: dict[str, Rows] = {}
    for pp in plan.planned:
        rows = {(p.module, p.dst_start + t): p.src_start + t for p in pp.pieces for t in range(p.length)}
        ours.update({k.removesuffix(up): rows for k in pp.part.keys if k.endswith(up)})
    result = ConverterResult(case, name, len(parts), len(theirs), 0, len(ours))
    for stem, rows in theirs.items():
        if stem not in ours:
            result.missed.append(stem)
        elif ours[stem] != rows:
            result.wrong.append(stem)
        else:
            result.ours += 1
    return result


# Classes of the newest tree only (no tiny build in helpers.comfy_arch_cases, which runs on v0.19.3 too):
# built from ComfyUI's supported_models class at tiny widths (ComfyUI's ops leave the weights empty:
# planning reads names and shapes only).
NEWEST_ONLY = {
    "krea2": ("Krea2", {"features": 256, "channels": 16, "patch": 2, "layers": 2, "heads": 2, "kvheads": 1,
                        "txtlayers": 4, "txtdim": 64}),
    "minimax-h3": ("MiniMaxH3", {"num_layers": 2, "token_refiner_num_layers": 1, "hidden_size": 128,
                                 "latents_dim": 8, "audio_latents_dim": 8, "attention_head_dim": 64,
                                 "num_attention_heads": 2, "ffn_hidden_size": 256, "text_dim": 64,
                                 "time_embed_hidden_size": 128, "time_embed_dim": 64}),
    "ideogram4": ("Ideogram4", {"in_channels": 32, "num_layers": 2, "num_attention_heads": 2,
                                "attention_head_dim": 64, "intermediate_size": 256, "adaln_dim": 32,
                                "llm_features_dim": 64, "mrope_section": [12, 10, 10]}),
    "ace-step": ("ACEStep15", {"hidden_size": 256, "num_heads": 2, "num_kv_heads": 1, "head_dim": 128,
                               "intermediate_size": 512, "num_dit_layers": 2, "num_lyric_layers": 1,
                               "num_timbre_layers": 1, "num_tokenizer_layers": 1, "text_hidden_dim": 64,
                               "encoder_hidden_size": 256, "encoder_intermediate_size": 512,
                               "encoder_num_heads": 2, "fsq_dim": 256}),
}  # fmt: skip


def newest_only_patcher(name: str):
    """A ModelPatcher of ComfyUI's own class for a NEWEST_ONLY case."""
    import comfy.model_patcher
    import comfy.supported_models

    cls, config = NEWEST_ONLY[name]
    model_config = getattr(comfy.supported_models, cls)(dict(config))
    model_config.unet_config.update(config)  # over the class's full-size unet_extra_config
    model_config.set_inference_dtype(torch.float32, None)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(
        model_config.get_model({}, ""), load_device=cpu, offload_device=cpu
    )


@dataclass
class Results:
    comfy: list[LayoutResult]
    diffusers: list[ConverterResult]


def all_results() -> Results:
    """Every case's results on the imported ComfyUI tree (builds each tiny model once, one at a time)."""
    from .comfy_arch_cases import CASES
    from .comfy_models import BUILDERS

    builders = {name: case.build for name, case in CASES.items()}
    builders |= {name: build for name, build in BUILDERS.items() if name not in builders}
    out = Results([], [])
    for name, build in builders.items():
        m = build()
        out.comfy += unet_results(name, m.patcher)
        if name in CLIPS:
            out.comfy += clip_results(name, m.clip)
        if name in CONVERTERS:
            out.diffusers.append(converter_result(name, m))
    for name in NEWEST_ONLY:
        out.comfy += unet_results(name, newest_only_patcher(name))
    return out
