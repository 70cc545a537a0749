"""The ComfyUI architecture cases: one tiny model per case, built the way ComfyUI loads it (builders in
helpers.comfy_models, comfy_dits, comfy_dits2, comfy_video), each naming the registry record ComfyUI's class
maps to (arch/record.py ComfyFacets), its forward, its row map onto the diffusers twin, ComfyUI core's
measured verdict per layout, and which checks and families it runs. tests/test_comfy_arch_names.py (layouts,
names, reference trees), test_comfy_arch_weights.py (families, fp64, runtime, parameters) and
test_comfy_arch_video.py (Wan 2.2's two experts) parametrize over this table; test_comfy_arch_names checks it
covers every record with ComfyUI facets.

References: `loraweave.apply` on the diffusers twin holding the same weights, ComfyUI's merged weights mapped
to the twin's names by the case's row map (TOL = 1e-6 relative per weight); the fp64 formula W + s·γ·up@down
on ComfyUI's own tensor rows; ComfyUI's own LoraLoader next to ours; the runtime forward within FORWARD_ATOL =
1e-5 (absolute, outputs of magnitude ~1) of the merge."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .comfy_checks import STRENGTH, TOL, all_linears, block_linears, comfy_modules, merged_state, rel
from .comfy_dits import DIT_BUILDERS
from .comfy_dits2 import DIT2_BUILDERS
from .comfy_files import FAMILIES, adapter_file, dotted, kohya
from .comfy_models import ComfyModel, tiny_qwen_image, tiny_z_image
from .comfy_video import VIDEO_BUILDERS, VIDEO_FORWARDS

LYCORIS = ("lora", "lokr", "loha")
# W-dependent families: their ΔW reads the weight's own rows, so on a fused qkv / linear1 slice (ComfyUI
# narrows the weight by the patch's offset) the DoRA norm and the OFT / BOFT rotations must see exactly the
# twin module's rows. "dora_in": the magnitude on the input axis (LyCORIS wd_on_out=False), a norm over every
# row of the module.
WEIGHT_FAMILIES = ("dora", "oft", "boft")


@dataclass(frozen=True)
class ArchCase:
    name: str  # the tiny model
    arch: (
        str | None
    )  # the registry record ComfyUI's class maps to; None: none (keys resolve on ComfyUI's names)
    build: Callable[[], ComfyModel]
    forward: Callable[[torch.nn.Module], torch.Tensor]  # ComfyUI's diffusion model on fixed inputs
    row_map: Callable[[ComfyModel], Callable[[dict], dict]]  # ComfyUI state (its names) -> the twin's names
    # ComfyUI's own LoraLoader on a LoRA, by layout (measured on both trees): "identical" (lands every key,
    # bit for bit as ours), "drops" (patches other keys than ours), "off" (lands, wrong rows). Layouts:
    # "kohya-diffusers" (kohya on the twin's names), "comfy" (kohya on ComfyUI's), "diffusers"
    # (`transformer.`), "peft".
    verdicts: dict[str, str]
    kohya_diffusers: tuple[str, ...] = ("lora",)  # families of kohya files on the twin's names
    kohya_comfy: tuple[str, ...] = ("lora",)  # families of kohya files on ComfyUI's names
    dotted: tuple[str, ...] = ()  # families of `transformer.`-named (diffusers, not PEFT) files
    peft: bool = True  # a PEFT file on the twin's names
    runtime: tuple[str, ...] = ("lora",)  # families of the runtime-equals-merge check
    runtime_linears: Callable[[torch.nn.Module], dict] = all_linears
    every_linear: bool = True  # every Linear lands, in ComfyUI's `diffusion_model.` and kohya-on-twin layouts
    every_linear_fp64: bool = False  # ... and the first also against the fp64 formula on ComfyUI's tensors
    # ComfyUI on the W-dependent families at strength 0.7 ({(family, layout): verdict}), where
    # checked.
    weight_verdicts: dict[tuple[str, str], str] = field(default_factory=dict)
    input_axis_dora: bool = False  # input-axis DoRA on fused slices (refused where ComfyUI splits a module)
    # Parameters on modules with children (ComfyUI accepts a patch there and never applies it): (those that
    # land, those named in the report); None: not checked.
    parent_parameters: tuple[list[str], list[str]] | None = None


def _identity(m: ComfyModel) -> Callable[[dict], dict]:
    # Qwen-Image: ComfyUI keeps the diffusers names (and diffusers has no converter for it).
    return lambda state: {k: state[k] for k in m.diffusers.state_dict()}


def _z_image_rows(m: ComfyModel) -> Callable[[dict], dict]:
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    return lambda state: convert_z_image_transformer_checkpoint_to_diffusers(dict(state))


def _inputs(*shapes):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(s, generator=g) for s in shapes]


T = torch.tensor([0.5])
GUIDANCE = torch.tensor([3.0])


def _qwen(dm):
    x, ctx = _inputs((1, 16, 1, 4, 4), (1, 5, 32))
    return dm(x, T, ctx)


def _z_image(dm):
    x, ctx = _inputs((1, 16, 4, 4), (1, 5, 32))
    return dm(x, T, ctx, 5)


def _sd3(dm):
    x, ctx, y = _inputs((1, 16, 4, 4), (1, 5, 32), (1, 32))
    return dm(x, T, ctx, y=y)


def _flux2(dm):
    x, ctx = _inputs((1, 128, 2, 2), (1, 5, 32))
    return dm(x, T, ctx, guidance=GUIDANCE)


def _chroma(dm):
    x, ctx = _inputs((1, 16, 4, 4), (1, 5, 32))
    return dm(x, T, ctx, torch.tensor([0.0]))


def _hunyuan(dm):
    x, ctx, y = _inputs((1, 16, 1, 4, 4), (1, 5, 32), (1, 768))
    return dm(x, T, ctx, y=y, guidance=GUIDANCE)


def _ltx2(dm):
    # Video and audio latents (8 channels x 16 mel bins) in, both out; the text context is the two processed
    # halves.
    v, a, ctx = _inputs((1, 16, 1, 2, 2), (1, 8, 4, 16), (1, 5, 64))
    return torch.cat([o.flatten() for o in dm([v, a], T, ctx)])


def _lumina2(dm):
    x, ctx = _inputs((1, 16, 4, 4), (1, 5, 32))
    return dm(x, T, ctx, 5)


def _hv15(dm):
    x, ctx, byt5, vision = _inputs((1, 65, 1, 4, 4), (1, 5, 32), (1, 3, 1472), (1, 2, 1152))
    return dm(x, T, ctx, txt_byt5=byt5, clip_fea=vision)


def _hi21(dm):
    x, ctx, byt5 = _inputs((1, 64, 4, 4), (1, 5, 32), (1, 3, 1472))
    return dm(x, T, ctx, txt_byt5=byt5, guidance=GUIDANCE, disable_time_r=True)


def _kandinsky5(dm):
    x, ctx, pooled = _inputs((1, 33, 1, 4, 4), (1, 5, 32), (1, 24))
    return dm(x, T, ctx, pooled)


def _ernie(dm):
    x, ctx = _inputs((1, 16, 4, 4), (1, 5, 32))
    return dm(x, T, ctx)


def _cosmos(dm):
    x, ctx = _inputs((1, 16, 1, 4, 4), (1, 5, 1024))
    return dm(x, T, ctx)


FORWARDS: dict[str, Callable[[torch.nn.Module], torch.Tensor]] = {
    "qwen-image": _qwen,
    "z-image": _z_image,
    "sd3": _sd3,
    "flux2": _flux2,
    "chroma": _chroma,
    "hunyuan-video": _hunyuan,
    "ltx2": _ltx2,
    "lumina2": _lumina2,
    "hunyuan-video-1.5": _hv15,
    "hunyuan-image-2.1": _hi21,
    "kandinsky5": _kandinsky5,
    "ernie-image": _ernie,
    "anima": _cosmos,
    "cosmos-predict2": _cosmos,
    **VIDEO_FORWARDS,
}


def _row_map_of(m) -> Callable[[dict], dict]:
    return m.as_diffusers


_COMFY_SAME = {"comfy": "identical"}
_PIXART_TABLES = ["blocks.0.scale_shift_table", "blocks.1.scale_shift_table", "final_layer.scale_shift_table"]
_VIDEO_VERDICTS: dict[str, dict[str, str]] = {
    **{
        n: {"comfy": "identical", "kohya-diffusers": "drops", "diffusers": "drops", "peft": "drops"}
        for n in ("wan22-5b", "wan-animate")
    },
    "ltx-video": {
        "comfy": "identical",
        "kohya-diffusers": "identical",
        "diffusers": "drops",
        "peft": "drops",
    },
    # kohya on diffusers names lands in core only where ComfyUI's names are diffusers' (HiDream, LTX-Video's
    # blocks); `transformer.` names only where core has a diffusers key map (PixArt, HiDream).
    "hidream": {
        "comfy": "identical",
        "kohya-diffusers": "identical",
        "diffusers": "identical",
        "peft": "identical",
    },
    **{
        n: {"comfy": "identical", "kohya-diffusers": "drops", "diffusers": "identical", "peft": "identical"}
        for n in ("pixart-sigma", "pixart-alpha")
    },
}
_VIDEO_PARENTS: dict[str, tuple[list[str], list[str]]] = {
    "wan22-5b": (["blocks.0.modulation", "blocks.1.modulation", "head.modulation"], []),
    "wan-animate": (
        [*(f"blocks.{i}.modulation" for i in range(5)), "face_encoder.padding_tokens", "head.modulation"],
        [],
    ),
    "ltx-video": (
        [
            "scale_shift_table",
            "transformer_blocks.0.scale_shift_table",
            "transformer_blocks.1.scale_shift_table",
        ],
        [],
    ),
    "hidream": ([], []),  # its MoE gate weights sit on childless modules: ordinary patches
    "pixart-sigma": (_PIXART_TABLES, []),
    "pixart-alpha": (_PIXART_TABLES, []),
}
_VIDEO_ARCHS = {"wan22-5b": "wan", "wan-animate": "wan-animate", "ltx-video": "ltx-video", "hidream": None,
                "pixart-sigma": "pixart", "pixart-alpha": "pixart"}  # fmt: skip
_DIT2_ARCHS = {"cosmos-predict2": "anima"}


def _cases() -> list[ArchCase]:
    # ComfyUI maps Z-Image's original names only; there its fused-qkv and SwiGLU merges are
    # bit-identical to ours. Qwen-Image keeps the diffusers names: core lands both layouts.
    out = [
        ArchCase(
            "qwen-image",
            "qwen-image",
            tiny_qwen_image,
            FORWARDS["qwen-image"],
            _identity,
            {"kohya-diffusers": "identical", "comfy": "identical"},
            FAMILIES,
            FAMILIES,
            runtime_linears=block_linears,
            every_linear=False,
        ),
        ArchCase(
            "z-image",
            "z-image",
            tiny_z_image,
            FORWARDS["z-image"],
            _z_image_rows,
            {"kohya-diffusers": "drops", "comfy": "identical"},
            FAMILIES,
            FAMILIES,
            runtime_linears=block_linears,
            every_linear=False,
        ),
    ]
    # ComfyUI maps each DiT's original names and lands them bit for bit as ours; kohya on diffusers names it
    # drops everywhere but LTX-2, whose diffusers names are its original ones but for a few renames. On the
    # W-dependent families it drops the twin's names where it drops LoRA's, and where it loads a file it is
    # off by more than 1e-6: its DoRA blends the strength outside the norm (issue 29), its OFT and BOFT apply
    # the strength twice.
    for name, build in DIT_BUILDERS.items():
        on_twin = "identical" if name == "ltx2" else "drops"
        weights = {(f, "diffusers"): "off" if name == "ltx2" else "drops" for f in WEIGHT_FAMILIES}
        weights |= {(f, "comfy"): "off" for f in WEIGHT_FAMILIES}
        out.append(
            ArchCase(
                name,
                name,
                build,
                FORWARDS[name],
                _row_map_of,
                {"kohya-diffusers": on_twin, **_COMFY_SAME},
                kohya_comfy=LYCORIS,
                runtime=("lora", *WEIGHT_FAMILIES),
                weight_verdicts=weights,
                input_axis_dora=True,
            )
        )
    # Kohya on diffusers names core drops but where the diffusers port kept the original names (Kandinsky 5,
    # ERNIE-Image). LoKr / LoHa where rows fuse or names change; Cosmos-Predict2 (Anima's DiT without the LLM
    # adapter) runs the checks that prove ComfyUI's class maps to that table, the layouts run on Anima.
    for name, build in DIT2_BUILDERS.items():
        on_twin = "identical" if name in ("kandinsky5", "ernie-image") else "drops"
        lycoris = name in ("hunyuan-video-1.5", "hunyuan-image-2.1", "anima")
        out.append(
            ArchCase(
                name,
                _DIT2_ARCHS.get(name, name),
                build,
                FORWARDS[name],
                _row_map_of,
                {"kohya-diffusers": on_twin, **_COMFY_SAME},
                kohya_comfy=LYCORIS if lycoris else ("lora",),
                peft=name != "cosmos-predict2",
                every_linear_fp64=True,
                parent_parameters=([], []),
            )
        )
    # Wan Animate's motion encoder (512 px) makes each check cost seconds: its `transformer.` names are
    # checked once (PEFT), LoKr / LoHa on ComfyUI's names only (its blocks are Wan's: test_comfy_weights.py).
    for name, build in VIDEO_BUILDERS.items():
        animate = name == "wan-animate"
        out.append(
            ArchCase(
                name,
                _VIDEO_ARCHS[name],
                build,
                FORWARDS[name],
                _row_map_of,
                _VIDEO_VERDICTS[name],
                kohya_diffusers=("lora",) if animate else LYCORIS,
                kohya_comfy=LYCORIS,
                dotted=() if animate else LYCORIS,
                parent_parameters=_VIDEO_PARENTS[name],
            )
        )
    return out


CASES: dict[str, ArchCase] = {c.name: c for c in _cases()}


def built_case(cache: dict, name: str):
    """The case's model, built on its first call in a row and kept until another case's is asked for: one tiny
    model at a time (tests/conftest.py runs these modules case by case)."""
    if name not in cache:
        cache.clear()
        cache[name] = CASES[name].build()
    return cache[name]


def layout_file(m, layout: str, family: str = "lora") -> dict[str, torch.Tensor]:
    """A `family` file on every block Linear in `layout` (ArchCase.verdicts' layouts)."""
    if layout == "kohya-diffusers":
        return adapter_file(block_linears(m.diffusers), family, kohya("lora_unet_"))
    if layout == "comfy":
        return adapter_file(block_linears(comfy_modules(m)), family, kohya("lora_unet_"))
    if layout == "diffusers":
        return adapter_file(block_linears(m.diffusers), family, dotted("transformer."))
    if layout == "peft":
        return adapter_file(block_linears(m.diffusers), family, dotted("transformer."), peft=True)
    raise ValueError(layout)


def dit_linears(m) -> dict[str, torch.nn.Linear]:
    """Every Linear of ComfyUI's model but Anima's LLM adapter (no module of the diffusers transformer)."""
    return {n: mod for n, mod in all_linears(comfy_modules(m)).items() if not n.startswith("llm_adapter.")}


def fp64_reference(m, sd: dict, where) -> dict[str, torch.Tensor]:
    """{ComfyUI weight: W + s·γ·up@down in fp64} for a LoRA file: `where(stem)` -> (ComfyUI module, first
    row)."""
    base = {k: v.double() for k, v in comfy_modules(m).state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for key in sd:
        if not key.endswith(".lora_down.weight"):
            continue
        stem = key.removesuffix(".lora_down.weight")
        up, down = sd[f"{stem}.lora_up.weight"].double(), sd[key].double()
        gamma = sd[f"{stem}.alpha"].item() / down.shape[0]
        module, row = where(stem)
        weight = out.setdefault(f"{module}.weight", base[f"{module}.weight"].clone())
        weight[row : row + up.shape[0]] += STRENGTH * gamma * (up @ down)
    return out


def check_fp64(m, sd: dict, where, model=None) -> None:
    """Our merge of `sd` (every key lands; `model`: a MODEL our loader patched with it already) equals the
    fp64 formula on ComfyUI's own tensors; every other weight is unchanged."""
    from loraweave.comfy import load_lora_for_models

    if model is None:
        model, _, report = load_lora_for_models(m.patcher, None, sd, STRENGTH, 0.0, mode="merge")
        assert report.keys_applied == report.keys_total == len(sd), report.kinds()
    ref, merged = fp64_reference(m, sd, where), merged_state(model)
    assert len(ref) >= 4
    errors = {k: rel(merged[k], ref[k]) for k in ref}
    assert max(errors.values()) <= TOL, max(errors.items(), key=lambda kv: kv[1])
    untouched = set(merged) - set(ref)
    base = comfy_modules(m).state_dict()
    assert all(torch.equal(merged[k], base[k]) for k in untouched), "a weight outside the file's keys changed"


def parent_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that sit directly on a module with children (ComfyUI never applies a patch there)."""
    return {
        f"{path}.{n}" if path else n: p
        for path, mod in module.named_modules()
        if any(True for _ in mod.children())
        for n, p in mod._parameters.items()
        if p is not None
    }


# Original names the trainers write for HunyuanVideo 1.5 / HunyuanImage 2.1 that ComfyUI's model fuses:
# musubi-tuner and sd-scripts split every double-block qkv, the official HunyuanImage code splits the single
# blocks' linear1.
_SPLIT = {
    r"(double_blocks\.\d+)\.(img|txt)_attn\.qkv": ("{0}.{1}_attn_{p}", "qkv"),
    r"(single_blocks\.\d+)\.linear1": ("{0}.linear1_{p}", ("q", "k", "v", "mlp")),
}
_TENCENT = (
    (".img_mod.lin", ".img_mod.linear"),
    (".txt_mod.lin", ".txt_mod.linear"),
    ("_attn.proj", "_attn_proj"),
    ("_mlp.0", "_mlp.fc1"),
    ("_mlp.2", "_mlp.fc2"),
    (".modulation.lin", ".modulation.linear"),
)


def split_original_file(m, seed: int = 5) -> tuple[dict, dict]:
    """A kohya LoRA on the trainers' split names over every double/single block Linear, and
    {stem: (ComfyUI module, first row)} of each key."""
    g = torch.Generator().manual_seed(seed)
    hidden = comfy_modules(m).hidden_size
    sd, where = {}, {}
    for name, mod in block_linears(comfy_modules(m)).items():
        parts = [(name, 0, mod.weight.shape[0], name)]
        for pattern, (spelling, pieces) in _SPLIT.items():
            if (hit := re.fullmatch(pattern, name)) is not None:
                rows = [hidden] * 3 + [mod.weight.shape[0] - 3 * hidden] * (len(pieces) == 4)
                starts = [sum(rows[:j]) for j in range(len(rows))]
                parts = [(spelling.format(*hit.groups(), p=p), s, n, name)
                         for p, s, n in zip(pieces, starts, rows, strict=True)]  # fmt: skip
        for original, start, rows_, comfy in parts:
            for old, new in _TENCENT:
                original = original.replace(old, new)
            stem = "lora_unet_" + original.replace(".", "_")
            sd[f"{stem}.lora_down.weight"] = torch.randn(2, mod.weight.shape[1], generator=g)
            sd[f"{stem}.lora_up.weight"] = torch.randn(rows_, 2, generator=g) * 0.1
            sd[f"{stem}.alpha"] = torch.tensor(1.0)
            where[stem] = (comfy, start)
    return sd, where
