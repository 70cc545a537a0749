"""Flux.2, HunyuanVideo and Krea2 original-name tables, checked against diffusers' own converters.

1. Oracle round trip (tiny models): every original name of our table becomes a checkpoint tensor (the pieces'
   rows concatenated in source order), diffusers' single-file converter turns it back into diffusers keys, and
   every weight must come back bit-exactly and every parameter of the model must be produced. Names the
   converter does not know are extra spellings and must equal a converter-known name (ComfyUI's HunyuanVideo
   renames) or what diffusers' `fuse_projections()` builds (`attn.to_qkv` / `attn.to_added_qkv`).
2. Full-size meta models: a LoRA on every original weight resolves 100% in kohya and ComfyUI spellings. The
   original names are written from the converters' own rename lists (not from our tables) and the converter
   itself confirms each one and gives its shape; together they must cover every 2-D+ weight of the model.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch
from conftest import REALDATA
from helpers.registry import patch_tables
from helpers.tiny_configs import CLASSES, TINY

import loraweave
from loraweave.arch.aliases import AliasTable
from loraweave.arch.spec import Rows

CONVERTERS = {
    "flux2": "convert_flux2_transformer_checkpoint_to_diffusers",
    "hunyuan": "convert_hunyuan_video_transformer_to_diffusers",
    "krea2": "convert_krea2_transformer_checkpoint_to_diffusers",
}
# Parameters that are not module weights (Krea2's per-block modulation tables): no alias can reach them.
NOT_MODULES = {"krea2": re.compile(r"(transformer_blocks\.\d+|final_layer)\.scale_shift_table$")}


def _converter(arch):
    from diffusers.loaders import single_file_utils

    return getattr(single_file_utils, CONVERTERS[arch])


def comfy_hunyuan_key(k: str) -> str:
    """ComfyUI `HunyuanVideo.process_unet_state_dict`: Tencent checkpoint key -> ComfyUI's internal key."""
    k = k.replace("txt_in.t_embedder.mlp.0.", "txt_in.t_embedder.in_layer.").replace(
        "txt_in.t_embedder.mlp.2.", "txt_in.t_embedder.out_layer."
    )
    k = k.replace("txt_in.c_embedder.linear_1.", "txt_in.c_embedder.in_layer.").replace(
        "txt_in.c_embedder.linear_2.", "txt_in.c_embedder.out_layer."
    )
    k = k.replace("_mod.linear.", "_mod.lin.").replace("_attn_qkv.", "_attn.qkv.")
    k = k.replace("mlp.fc1.", "mlp.0.").replace("mlp.fc2.", "mlp.2.")
    k = k.replace("_attn_q_norm.weight", "_attn.norm.query_norm.scale").replace(
        "_attn_k_norm.weight", "_attn.norm.key_norm.scale"
    )
    k = k.replace(".q_norm.weight", ".norm.query_norm.scale").replace(
        ".k_norm.weight", ".norm.key_norm.scale"
    )
    k = k.replace("_attn_proj.", "_attn.proj.").replace(".modulation.linear.", ".modulation.lin.")
    return k.replace("_in.mlp.2.", "_in.out_layer.").replace("_in.mlp.0.", "_in.in_layer.")


def oracle(model, arch: str) -> list[str]:
    """Problems found by round-tripping every original name of our table through diffusers' converter."""
    table, state, convert = AliasTable(model), model.state_dict(), _converter(arch)
    problems, produced, known, extra = [], set(), {}, {}
    for name, pieces in table.exact.items():
        if name in table.modules:
            continue
        entry = {}
        for suffix in ("weight", "bias"):
            parts = [getattr(table.modules[p.module], suffix, None) for p in pieces]
            if any(t is None for t in parts):
                continue
            rms = "RMSNorm" in type(table.modules[pieces[0].module]).__name__
            key = f"{name}.{'scale' if suffix == 'weight' and rms and arch != 'hunyuan' else suffix}"
            entry[key] = torch.cat(
                [t.detach()[p.dst_start : p.dst_start + p.length] for t, p in zip(parts, pieces, strict=True)]
            )
        out = convert(dict(entry))
        if not out or not out.keys() <= state.keys():
            extra[name] = entry
            continue
        known[name] = pieces
        produced |= out.keys()
        problems += [f"{name} -> {k}" for k, v in out.items() if not torch.equal(v, state[k])]
    for key in state.keys() - produced:
        if not (arch in NOT_MODULES and NOT_MODULES[arch].search(key)):
            problems.append(f"not produced: {key}")
    comfy = (
        {comfy_hunyuan_key(f"{n}.weight").rsplit(".", 1)[0]: n for n in known} if arch == "hunyuan" else {}
    )
    fused = {}
    if any(n.endswith(("attn.to_qkv", "attn.to_added_qkv")) for n in extra):
        clone = copy.deepcopy(model)
        for m in list(clone.modules()):
            if getattr(m, "_supports_qkv_fusion", False) and hasattr(m, "to_q"):
                m.fuse_projections()
        fused = dict(clone.named_modules())
    for name, entry in extra.items():
        if name in comfy:
            if table.exact[name] != known[comfy[name]]:
                problems.append(f"{name} != {comfy[name]}")
        elif name.endswith(("attn.to_qkv", "attn.to_added_qkv")) and name in fused:
            for key, value in entry.items():
                if not torch.equal(value, getattr(fused[name], key.rsplit(".", 1)[1])):
                    problems.append(f"{key} != fuse_projections()")
        else:
            problems.append(f"unknown to the converter: {name}")
    return problems


@pytest.fixture(scope="module")
def tiny():
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = TINY[arch]()
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", sorted(TINY))
def test_table_round_trips_through_the_diffusers_converter(arch, tiny):
    model = tiny(arch)
    assert oracle(model, arch) == []
    table = AliasTable(model)
    assert len([n for n in table.exact if n not in table.modules]) > 20


def _mutate(table, source: str, fn):
    aliases = tuple(
        dataclasses.replace(a, targets=fn(a.targets)) if a.source == source else a for a in table.aliases
    )
    assert aliases != table.aliases
    return dataclasses.replace(table, aliases=aliases)


@pytest.mark.parametrize(
    "arch, source, fn",
    [
        ("flux2", "double_blocks.{i}.txt_attn.qkv", lambda t: (t[0], t[2], t[1])),
        (
            "flux2",
            "final_layer.adaLN_modulation.1",
            lambda t: (Rows(t[0].module, 0, 2), Rows(t[0].module, 1, 2)),
        ),
        ("krea2", "transformer_blocks.{i}.attn.to_qkv", lambda t: (t[0], t[2], t[1])),
        ("krea2", "blocks.{i}.mlp.gate", lambda t: (t[0].replace("gate", "up"),)),
    ],
)
def test_oracle_catches_a_broken_row_order(arch, source, fn, monkeypatch, tiny):
    patch_tables(monkeypatch, lambda t: _mutate(t, source, fn) if t.name == arch else t)
    assert oracle(TINY[arch](), arch) != []


def test_hunyuan_both_spellings_share_pieces(tiny):
    table = AliasTable(tiny("hunyuan"))
    assert table.exact["double_blocks.0.img_attn_qkv"] == table.exact["double_blocks.0.img_attn.qkv"]
    assert table.exact["single_blocks.0.modulation.lin"] == table.exact["single_blocks.0.modulation.linear"]
    linear1 = table.exact["single_blocks.0.linear1"]
    assert [p.module.rsplit(".", 1)[1] for p in linear1] == ["to_q", "to_k", "to_v", "proj_mlp"]
    assert [p.length for p in linear1] == [3072, 3072, 3072, 768]


# Original module names, from the converters' rename lists; {i} counts over the config field named with it
# (`guidance_embeds`: 0 or 1).
ORIGINAL = {
    "flux2": {
        None: [
            "img_in",
            "txt_in",
            "time_in.in_layer",
            "time_in.out_layer",
            "double_stream_modulation_img.lin",
            "double_stream_modulation_txt.lin",
            "single_stream_modulation.lin",
            "final_layer.linear",
            "final_layer.adaLN_modulation.1",
        ],
        "guidance_embeds": ["guidance_in.in_layer", "guidance_in.out_layer"],
        "num_layers": [
            f"double_blocks.{{i}}.{s}_{m}"
            for s in ("img", "txt")
            for m in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")
        ],
        "num_single_layers": ["single_blocks.{i}.linear1", "single_blocks.{i}.linear2"],
    },
    "hunyuan": {
        None: [
            "img_in.proj",
            "time_in.mlp.0",
            "time_in.mlp.2",
            "vector_in.in_layer",
            "vector_in.out_layer",
            "final_layer.linear",
            "final_layer.adaLN_modulation.1",
            "txt_in.input_embedder",
            "txt_in.t_embedder.mlp.0",
            "txt_in.t_embedder.mlp.2",
            "txt_in.c_embedder.linear_1",
            "txt_in.c_embedder.linear_2",
        ],
        "guidance_embeds": ["guidance_in.mlp.0", "guidance_in.mlp.2"],
        "num_layers": [
            f"double_blocks.{{i}}.{s}_{m}"
            for s in ("img", "txt")
            for m in ("attn_qkv", "attn_proj", "mod.linear", "mlp.fc1", "mlp.fc2")
        ],
        "num_single_layers": [
            "single_blocks.{i}.linear1",
            "single_blocks.{i}.linear2",
            "single_blocks.{i}.modulation.linear",
        ],
        "num_refiner_layers": [
            f"txt_in.individual_token_refiner.blocks.{{i}}.{m}"
            for m in ("self_attn_qkv", "self_attn_proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1")
        ],
    },
    "krea2": {
        None: [
            "first",
            "tmlp.0",
            "tmlp.2",
            "tproj.1",
            "txtmlp.1",
            "txtmlp.3",
            "txtfusion.projector",
            "last.linear",
        ],
        **{
            n: [
                f"{b}.{{i}}.{m}"
                for m in (
                    "attn.wq",
                    "attn.wk",
                    "attn.wv",
                    "attn.wo",
                    "attn.gate",
                    "mlp.gate",
                    "mlp.up",
                    "mlp.down",
                )
            ]
            for n, b in (
                ("num_layers", "blocks"),
                ("num_layerwise_text_blocks", "txtfusion.layerwise_blocks"),
                ("num_refiner_text_blocks", "txtfusion.refiner_blocks"),
            )
        },
    },
}


def _hunyuan_configs():
    configs = json.loads(
        (REALDATA / "configs" / "hunyuanvideo__diffusers_transformer_configs.json").read_text()
    )
    return [pytest.param("hunyuan", c, id=f"hunyuan-{name}") for name, c in configs.items()]


FULL = [
    pytest.param("flux2", {}, id="flux2-defaults"),
    *_hunyuan_configs(),
    pytest.param("krea2", {}, id="krea2-defaults"),
]


@pytest.mark.parametrize("arch, config", FULL)
def test_every_original_weight_resolves_on_the_full_size_model(arch, config, realdata):
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, CLASSES[arch])(**config)
    cfg, state, convert = model.config, model.state_dict(), _converter(arch)
    shapes, landed = {}, set()
    for field, templates in ORIGINAL[arch].items():
        for i in range(int(cfg[field]) if field else 1):
            for name in (t.replace("{i}", str(i)) for t in templates):
                out = list(convert({f"{name}.weight": torch.empty(6 * 36864, 8, device="meta")}))
                assert out and all(k in state for k in out), (name, out)
                shapes[name] = (sum(state[k].shape[0] for k in out), *state[out[0]].shape[1:])
                landed |= set(out)
    weights = {
        f"{n}.weight"
        for n, m in model.named_modules()
        if isinstance(getattr(m, "weight", None), torch.Tensor)
    }
    weights = {w for w in weights if state[w].dim() >= 2}
    assert weights <= landed, sorted(weights - landed)[:5]
    spellings = [shapes]
    if arch == "hunyuan":  # ComfyUI's internal (Flux-style) names, as diffusion-pipe-era loaders rename them
        spellings.append(
            {comfy_hunyuan_key(f"{n}.weight").removesuffix(".weight"): s for n, s in shapes.items()}
        )
        assert spellings[1].keys() != shapes.keys()
    for names in spellings:
        for layout in ("kohya", "comfyui"):
            sd = {}
            for name, shape in names.items():
                stem = (
                    "lora_unet_" + name.replace(".", "_") if layout == "kohya" else f"diffusion_model.{name}"
                )
                down, up = ("lora_down", "lora_up") if layout == "kohya" else ("lora_A", "lora_B")
                sd[f"{stem}.{down}.weight"] = torch.empty([4, *shape[1:]], device="meta")
                sd[f"{stem}.{up}.weight"] = torch.empty([shape[0], 4] + [1] * (len(shape) - 2), device="meta")
            report = loraweave.plan(model, sd)
            assert report.unmatched == [], report.unmatched[:3]
            assert report.keys_applied == report.keys_total == len(sd)
            assert {f"{m.module}.weight" for m in report.applied} == weights
