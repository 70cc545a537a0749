"""Detection and full-size coverage of the architectures whose original-name tables landed last.

For each: the converter-derived key list of the full-size model (the table tests' own helpers, original names)
is detected as that architecture, and `inspect` (the API the CLI prints) lands 100 % of its keys on the
catalog's full-size meta skeleton. Negative controls: the same names at another width are not called the same
architecture, and without the new signatures the names are misdetected.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.arch_layouts import (
    _anima,
    anima_file,
    h3_lora_names,
    ideogram4_lora_names,
    linears,
    lora_file,
    ltx2_original,
    lumina2_lora_names,
    qwen21_lora_names,
    sana_original,
)
from helpers.registry import patch_records
from helpers.tiny_configs import ANIMA_DIT, LTX2_FULL

import loraweave
from loraweave.arch import registry
from loraweave.arch.catalog import CATALOG
from loraweave.arch.detect import detect_architecture
from loraweave.tools.inspect import format_table, inspect_adapter


def _model(cls: str, **config):
    import diffusers

    with torch.device("meta"):
        return getattr(diffusers, cls)(**config)


def from_shapes(
    shapes: dict[str, tuple[int, int]], prefix: str = "diffusion_model."
) -> dict[str, torch.Tensor]:
    """A rank-2 LoRA (meta tensors: names and shapes only) on every {stem: (rows, in)}."""
    sd = {}
    for stem, (rows, inp) in shapes.items():
        sd[f"{prefix}{stem}.lora_A.weight"] = torch.empty(2, inp, device="meta")
        sd[f"{prefix}{stem}.lora_B.weight"] = torch.empty(rows, 2, device="meta")
    return sd


def _sana_shapes(model) -> dict[str, tuple]:
    """Every Linear / conv weight of Sana's original checkpoint (the converter's input names), as LoRA
    shapes."""
    weights = sana_original(model, lambda n, s: torch.empty(s, device="meta"))
    return {
        k.removesuffix(".weight"): (v.shape[0], v.shape[1])
        for k, v in weights.items()
        if k.endswith(".weight") and v.dim() == 2
    }


def _sana_file(model) -> dict[str, torch.Tensor]:
    sd = from_shapes(_sana_shapes(model))
    weights = sana_original(model, lambda n, s: torch.empty(s, device="meta"))
    for (
        k,
        v,
    ) in weights.items():  # the convs: LoCon-style lora_A (rank, in, kh, kw) / lora_B (out, rank, 1, 1)
        if k.endswith(".weight") and v.dim() == 4:
            stem = k.removesuffix(".weight")
            sd[f"diffusion_model.{stem}.lora_A.weight"] = torch.empty(2, *v.shape[1:], device="meta")
            sd[f"diffusion_model.{stem}.lora_B.weight"] = torch.empty(v.shape[0], 2, 1, 1, device="meta")
    return sd


def _diffusers_names(cls: str, prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    return lora_file(linears(_model(cls)), lambda n: f"{prefix}{n}", meta=True)


# architecture -> builder of its full-size key list (original names where a table exists).
FILES = {
    "minimax-h3": lambda: from_shapes(h3_lora_names(_model("MiniMaxH3Transformer3DModel"))),
    "ideogram4": lambda: from_shapes(ideogram4_lora_names(_model("Ideogram4Transformer2DModel"))),
    "qwen-image-2.1": lambda: from_shapes(qwen21_lora_names(_model("QwenImage21Transformer2DModel"))),
    "lumina2": lambda: from_shapes(lumina2_lora_names(_model("Lumina2Transformer2DModel"))),
    "sana": lambda: _sana_file(_model("SanaTransformer2DModel")),
    "anima": lambda: anima_file(_anima(True, ANIMA_DIT, {}), meta=True),
    "ltx2": lambda: lora_file(
        linears(_model("LTX2VideoTransformer3DModel")),
        lambda n: f"diffusion_model.{ltx2_original(n)}",
        meta=True,
    ),
    "ltx2.3": lambda: lora_file(
        linears(_model("LTX2VideoTransformer3DModel", **LTX2_FULL)),
        lambda n: f"diffusion_model.{ltx2_original(n)}",
        meta=True,
    ),
    "ernie-image": lambda: _diffusers_names("ErnieImageTransformer2DModel", "diffusion_model."),
    "kandinsky5": lambda: _diffusers_names("Kandinsky5Transformer3DModel"),
    "hunyuan-video-1.5": lambda: _diffusers_names("HunyuanVideo15Transformer3DModel"),
    "hunyuan-image-2.1": lambda: _diffusers_names("HunyuanImageTransformer2DModel"),
    # HunyuanVideo 1.0's diffusers names are Flux's at Flux's width: its own refiner names and its depth
    # decide.
    "hunyuan-video": lambda: lora_file(
        linears(_model("HunyuanVideoTransformer3DModel", **CATALOG["hunyuan-video"].config)),
        lambda n: f"transformer.{n}",
        meta=True,
    ),
    # Its MMDiT attention names no longer outvote its own img/txt mlp and mod names (was "flux" by width
    # 3072).
    "qwen-image": lambda: lora_file(
        linears(_model("QwenImageTransformer2DModel", **CATALOG["qwen-image"].config)),
        lambda n: f"transformer.{n}",
        meta=True,
    ),
}
KOHYA = (
    "minimax-h3",
    "ideogram4",
    "qwen-image-2.1",
    "lumina2",
    "sana",
    "ltx2.3",
    "kandinsky5",
    "hunyuan-video",
)


def kohya(sd: dict) -> dict[str, torch.Tensor]:
    """kohya/musubi spelling: `lora_unet_` + the dotted path flattened, lora_down/lora_up."""
    out = {}
    for key, v in sd.items():
        stem, _, role = key.partition(".lora_")
        stem = stem.removeprefix("diffusion_model.").removeprefix("transformer.")
        out[f"lora_unet_{stem.replace('.', '_')}.lora_{'down' if role.startswith('A') else 'up'}.weight"] = v
    return out


@pytest.fixture(scope="module")
def files():
    return {}


def _file(files: dict, arch: str) -> dict[str, torch.Tensor]:
    if arch not in files:
        files[arch] = FILES[arch]()
    return files[arch]


@pytest.mark.parametrize("arch", sorted(FILES))
def test_detected_and_fully_covered(arch, files):
    sd = _file(files, arch)
    detection = detect_architecture(loraweave.load_adapter(sd))
    assert detection.architecture == arch, (detection.scores, detection.evidence)
    info = inspect_adapter(sd, text_encoders=False)
    cov = info["coverage"]
    assert info["architecture"]["name"] == arch
    assert cov["against"] == f"architecture {arch} (full size, meta device)"
    assert cov["unmatched"] == [] and cov["keys_applied"] == cov["keys_total"] == len(sd), cov["unmatched"][
        :3
    ]


@pytest.mark.parametrize("arch", KOHYA)
def test_kohya_flattened_names_detected_the_same(arch, files):
    sd = kohya(_file(files, arch))
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == arch


def test_anima_llm_adapter_keys_land_on_the_text_conditioner(files):
    """The catalog's Anima skeleton carries the pipeline's `text_conditioner`: the file's llm_adapter keys
    land."""
    info = inspect_adapter(_file(files, "anima"), text_encoders=False)
    assert set(info["coverage"]["modules"]) == {"transformer", "text_conditioner"}


def _rescaled(sd: dict, old: int, new: int) -> dict[str, torch.Tensor]:
    """The same names with every `old`-wide dimension made `new` wide: a file of the same layout at another
    width."""
    return {k: torch.empty([new if d == old else d for d in v.shape], device="meta") for k, v in sd.items()}


def test_width_tells_lumina2_from_z_image(files):
    """Lumina2 and Z-Image original names are the same; the hidden width decides. Negative control: the
    Lumina2 file at Z-Image's width (3840) is z-image, not lumina2."""
    sd = _file(files, "lumina2")
    at_zimage = _rescaled(sd, 2304, 3840)
    detection = detect_architecture(loraweave.load_adapter(at_zimage))
    assert detection.architecture == "z-image" != "lumina2"
    odd = detect_architecture(loraweave.load_adapter(_rescaled(sd, 2304, 1000)))
    assert odd.architecture == "z-image"  # a width no release has: the names' first owner, as before


def test_ideogram4_shared_names_alone_by_width(files):
    """An Ideogram4 file of only the names Z-Image shares (qkv, w1-3) is named by its width (4608)."""
    shared = {
        k: v for k, v in _file(files, "ideogram4").items() if ".attention.qkv." in k or ".feed_forward." in k
    }
    detection = detect_architecture(loraweave.load_adapter(shared))
    assert detection.architecture == "ideogram4" and any("hidden width 4608" in e for e in detection.evidence)
    assert (
        detect_architecture(loraweave.load_adapter(_rescaled(shared, 4608, 3840))).architecture == "z-image"
    )


@pytest.mark.parametrize(
    "arch, without, misread",
    [
        ("minimax-h3", ("minimax-h3",), "unknown"),
        ("ideogram4", ("ideogram4",), "z-image"),
        ("qwen-image-2.1", ("qwen-image-2.1",), "qwen-image"),
        ("sana", ("sana",), "wan"),
    ],
)
def test_without_the_new_signature_it_is_misread(monkeypatch, files, arch, without, misread):
    """Negative control: dropping the architecture's signature (and the width rule) gives the old (wrong)
    answer."""
    patch_records(monkeypatch, without, signature=None)
    patch_records(monkeypatch, ("z-image", "cross-dit"), widths=None)  # the fold's width rules
    assert detect_architecture(loraweave.load_adapter(_file(files, arch))).architecture == misread


def test_without_shared_names_mmdit_names_outvote_the_owner(monkeypatch, files):
    """Negative control: without the mmdit record's owners a full Qwen-Image file is called flux (by width
    3072) and an LTX-2 file's shared names count for sd3 (its attn2 read as SD3.5's dual attention)."""
    patch_records(monkeypatch, ("mmdit",), owners=())
    patch_records(monkeypatch, None, depth=None)  # which would name it by its 60 double-stream blocks
    assert detect_architecture(loraweave.load_adapter(_file(files, "qwen-image"))).architecture == "flux"
    assert "sd3" in detect_architecture(loraweave.load_adapter(_file(files, "ltx2"))).scores


@pytest.mark.parametrize("cls", ["Kandinsky6Transformer3DModel", "Kandinsky6SRTransformer3DModel"])
def test_kandinsky6_is_not_called_kandinsky5(cls):
    """Kandinsky 6 shares Kandinsky 5's block names; its own (`attn.`, `feed_forward.net`, audio tower)
    decide. No catalog entry: inspect says there is no full-size model instead of checking it against
    Kandinsky 5's."""
    sd = _diffusers_names(cls)
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == "kandinsky6"
    assert inspect_adapter(sd, text_encoders=False)["coverage"]["against"] is None


@pytest.mark.parametrize("arch", ["ideogram4", "lumina2"])
def test_cli_inspect_json_on_a_file(tmp_path, capsys, files, arch):
    """The CLI on a real safetensors file (bf16 zeros in the key list's shapes): named and 100 % with
    --strict."""
    from safetensors.torch import save_file

    from loraweave.cli import main

    path = tmp_path / f"{arch}.safetensors"
    save_file(
        {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in _file(files, arch).items()}, str(path)
    )
    assert main(["inspect", "--json", "--strict", "--no-text-encoders", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"]["name"] == arch
    assert (
        info["coverage"]["complete"]
        and info["coverage"]["keys_applied"] == info["coverage"]["keys_total"] > 0
    )


def _blocks_only(sd: dict, doubles: int | None = None, singles: int | None = None) -> dict[str, torch.Tensor]:
    """The file's transformer-block keys only (what most trained LoRAs hold), optionally the first blocks
    only."""
    import re

    out = {}
    for k, v in sd.items():
        m = re.match(r"transformer\.(single_)?transformer_blocks\.(\d+)\.", k)
        limit = (singles if m and m[1] else doubles) if m else None
        if m and (limit is None or int(m[2]) < limit):
            out[k] = v
    return out


def test_hunyuan_video_blocks_told_from_flux_by_depth(monkeypatch, files):
    """A HunyuanVideo LoRA on its blocks only has nothing but Flux's names at Flux's width: its 20th
    double-stream and 39th-40th single-stream blocks, which Flux.1 does not have, decide. Negative control:
    without the depth facets it is flux. A file that stops before block 19 / 38 cannot be told apart and stays
    flux (the more common)."""
    blocks = _blocks_only(_file(files, "hunyuan-video"))
    detection = detect_architecture(loraweave.load_adapter(blocks))
    assert detection.architecture == "hunyuan-video", (detection.scores, detection.evidence)
    assert any("double-stream block 19" in e for e in detection.evidence)
    info = inspect_adapter(blocks, text_encoders=False)
    assert info["coverage"]["keys_applied"] == info["coverage"]["keys_total"] == len(blocks)
    singles_only = {k: v for k, v in blocks.items() if ".single_transformer_blocks." in k}
    assert detect_architecture(loraweave.load_adapter(singles_only)).architecture == "hunyuan-video"
    shallow = _blocks_only(_file(files, "hunyuan-video"), doubles=19, singles=38)
    assert detect_architecture(loraweave.load_adapter(shallow)).architecture == "flux"
    patch_records(monkeypatch, None, depth=None)
    assert detect_architecture(loraweave.load_adapter(blocks)).architecture == "flux"


def test_qwen_image_attention_only_is_not_flux(monkeypatch, files):
    """A Qwen-Image LoRA on attention only (Flux's MMDiT names, width 3072) indexes 60 double-stream blocks
    and no single-stream one: Qwen-Image. Negative control: without the depth facets it was flux."""
    attn = {k: v for k, v in _file(files, "qwen-image").items() if ".attn." in k}
    assert detect_architecture(loraweave.load_adapter(attn)).architecture == "qwen-image"
    patch_records(monkeypatch, None, depth=None)
    assert detect_architecture(loraweave.load_adapter(attn)).architecture == "flux"


# Cross-attention DiTs in diffusers names (self-attention attn1, cross-attention attn2, ff.net): class
# defaults.
CROSS_DITS = {
    "ltx-video": "LTXVideoTransformer3DModel",
    "pixart": "PixArtTransformer2DModel",
    "sana": "SanaTransformer2DModel",
}


def _ltx2_video_only(prefix: str) -> dict[str, torch.Tensor]:
    """The LoRA most LTX-2 trainers write: the video tower's attention and feed-forward only, no audio
    names."""
    keep = {
        n: m
        for n, m in linears(_model("LTX2VideoTransformer3DModel")).items()
        if n.split(".")[0] == "transformer_blocks" and n.split(".")[2] in ("attn1", "attn2", "ff")
    }
    return lora_file(keep, lambda n: f"{prefix}{n}", meta=True)


@pytest.mark.parametrize("arch", sorted(CROSS_DITS))
def test_cross_attention_dits_in_diffusers_names_are_not_sd3(arch):
    """attn2 next to attn1 is a cross-attention DiT, not SD3.5's dual attention (which these files were
    called), and every key lands on the architecture's full-size skeleton."""
    sd = _diffusers_names(CROSS_DITS[arch])
    detection = detect_architecture(loraweave.load_adapter(sd))
    assert detection.architecture == arch, (detection.scores, detection.evidence)
    cov = inspect_adapter(sd, text_encoders=False)["coverage"]
    assert cov["against"] == f"architecture {arch} (full size, meta device)"
    assert cov["keys_applied"] == cov["keys_total"] == len(sd), cov["unmatched"][:3]


@pytest.mark.parametrize("prefix", ["transformer.", "diffusion_model."])
def test_ltx2_video_only_file_is_ltx2_and_fully_covered(prefix):
    """No audio names: the width (4096) names LTX-2, and every key lands on its full-size skeleton."""
    sd = _ltx2_video_only(prefix)
    detection = detect_architecture(loraweave.load_adapter(sd))
    assert detection.architecture == "ltx2", (detection.scores, detection.evidence)
    assert any("hidden width 4096" in e for e in detection.evidence)
    info = inspect_adapter(sd, text_encoders=False)
    cov = info["coverage"]
    assert cov["keys_applied"] == cov["keys_total"] == len(sd), cov["unmatched"][:3]
    assert "variant" not in format_table(
        info
    )  # arch.variants lists no LTX-2 release: no "no known variant" row


def test_sd35_dual_attention_is_still_sd3():
    """SD3.5 Medium (attn + attn2 in its first 13 blocks, hidden 1536) is still sd3, and a file of its attn2
    names alone is too, by the dual-attention rule."""
    model = _model(
        "SD3Transformer2DModel",
        **{**CATALOG["sd3"].config, "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"},
    )
    sd = lora_file(linears(model), lambda n: f"transformer.{n}", meta=True)
    assert any(".attn2." in k for k in sd)
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == "sd3"
    # attn2 without attn1 is still SD3.5's dual attention (the rule the cross-dit names now bypass)
    detection = detect_architecture(loraweave.load_adapter({k: v for k, v in sd.items() if ".attn2." in k}))
    assert detection.architecture == "sd3" and any("dual attention" in e for e in detection.evidence)


def test_negative_control_without_the_cross_dit_rule_they_read_as_sd3(monkeypatch):
    """Without the cross-dit signature (and Sana's diffusers ff names) these files are sd3, as they were."""
    patch_records(monkeypatch, ("cross-dit", "sana"), signature=None)
    for sd in (_ltx2_video_only("transformer."), *(_diffusers_names(c) for c in CROSS_DITS.values())):
        assert detect_architecture(loraweave.load_adapter(sd)).architecture == "sd3"
    # attn2 without attn1 is still SD3.5's dual attention (the rule the cross-dit names now bypass)
    detection = detect_architecture(loraweave.load_adapter({k: v for k, v in sd.items() if ".attn2." in k}))
    assert detection.architecture == "sd3" and any("dual attention" in e for e in detection.evidence)


def test_cosmos_diffusers_names_are_a_cross_dit_not_ltx_video():
    """Cosmos-Predict2 2B has LTX-Video 0.9's hidden width (2048) and names, but reads 1024-wide text in
    attn2: it is named only as the family. Negative control: without the same-width rule it is called
    ltx-video."""
    sd = lora_file(
        linears(_model("CosmosTransformer3DModel", **CATALOG["anima"].config)),
        lambda n: f"transformer.{n}",
        meta=True,
    )
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == "cross-dit"
    with pytest.MonkeyPatch.context() as mp:
        cross_dit = registry.by_name()["cross-dit"]
        patch_records(mp, ("cross-dit",), widths=dataclasses.replace(cross_dit.widths, same_width=None))
        assert detect_architecture(loraweave.load_adapter(sd)).architecture == "ltx-video"


@pytest.mark.parametrize("arch", [*sorted(CROSS_DITS), "ltx2 video-only"])
def test_cross_attention_dits_in_kohya_names(arch):
    """musubi/kohya spelling (lora_unet_ + flattened names) of the same files: the same answers."""
    sd = kohya(
        _ltx2_video_only("diffusion_model.")
        if arch == "ltx2 video-only"
        else _diffusers_names(CROSS_DITS[arch])
    )
    assert detect_architecture(loraweave.load_adapter(sd)).architecture == arch.split()[0]
