"""`loraweave convert`: layout round trips reproduce identical merged weights; fused rows split and joined."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.cli import main
from loraweave.errors import ConvertError
from loraweave.tools.convert import convert
from loraweave.tools.skeleton import CACHE_ENV

sys.path.insert(0, str(Path(__file__).parent))
from helpers.tiny_models import tiny_flux  # noqa: E402

REALDATA = Path(__file__).resolve().parents[2] / "shared" / "realdata"
H = 32  # tiny Flux hidden size


@pytest.fixture(autouse=True, scope="module")
def _skeleton_cache(tmp_path_factory):
    """Architecture skeletons cached in a temp folder, never in the user's home."""
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("skeletons"))
    yield
    os.environ.pop(CACHE_ENV) if old is None else os.environ.__setitem__(CACHE_ENV, old)


def _pair(
    sd: dict,
    stem: str,
    rows: int,
    cols: int,
    g,
    rank: int = 4,
    alpha: float | None = None,
    names=(".lora_down.weight", ".lora_up.weight"),
) -> None:
    sd[stem + names[0]] = torch.randn(rank, cols, generator=g) * 0.2
    sd[stem + names[1]] = torch.randn(rows, rank, generator=g) * 0.2
    if alpha is not None:
        sd[stem + ".alpha"] = torch.tensor(alpha)


def kohya_flux(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    _pair(sd, "lora_unet_double_blocks_0_img_attn_qkv", 3 * H, H, g, alpha=8.0)  # fused: split into q, k, v
    _pair(sd, "lora_unet_double_blocks_1_txt_attn_qkv", 3 * H, H, g, rank=2, alpha=1.0)
    _pair(sd, "lora_unet_single_blocks_0_linear1", 3 * H + 4 * H, H, g, alpha=4.0)  # q | k | v | mlp
    _pair(sd, "lora_unet_single_blocks_1_linear2", H, H + 4 * H, g, alpha=2.0)
    _pair(sd, "lora_unet_final_layer_adaLN_modulation_1", 2 * H, H, g, alpha=4.0)  # shift/scale swapped
    _pair(sd, "lora_unet_double_blocks_0_img_mod_lin", 6 * H, H, g, rank=8, alpha=8.0)
    return sd


def diffusers_flux(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    peft = (".lora_A.weight", ".lora_B.weight")
    for proj in ("to_q", "to_k", "to_v"):  # separate A per projection: joined by rank concatenation
        _pair(sd, f"transformer.transformer_blocks.1.attn.{proj}", H, H, g, names=peft)
        _pair(sd, f"transformer.single_transformer_blocks.1.attn.{proj}", H, H, g, names=peft)
    _pair(sd, "transformer.single_transformer_blocks.1.proj_mlp", 4 * H, H, g, names=peft)
    _pair(sd, "transformer.norm_out.linear", 2 * H, H, g, names=peft)
    _pair(sd, "transformer.proj_out", 16, H, g, rank=3, names=peft)
    _pair(sd, "transformer.transformer_blocks.0.ff.net.2", H, 4 * H, g, rank=6, names=peft)
    return sd


@pytest.fixture(scope="module")
def model():
    return tiny_flux(seed=2)


def _merged(model, adapter) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    loraweave.apply(m, adapter, mode="merge", strict=True, strength=0.8)
    return m.state_dict()


def _assert_identical(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_kohya_peft_kohya_round_trip(model, tmp_path):
    src = tmp_path / "kohya.safetensors"
    original = kohya_flux()
    save_file(original, src)
    res = convert(src, "peft", tmp_path / "peft", target=model)
    assert res.splits == 3 * 2 + 4 + 0 and res.joins == 0  # 2 fused qkv -> 3 each, linear1 -> 4
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["alpha_pattern"]  # ranks/alphas differ per module
    peft_sd = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.") for k in peft_sd)
    assert "base_model.model.norm_out.linear.lora_B.weight" in peft_sd
    _assert_identical(_merged(model, str(src)), _merged(model, str(tmp_path / "peft")))
    back = tmp_path / "back.safetensors"
    res = convert(tmp_path / "peft", "kohya", back, target=model)
    assert res.joins == 3  # qkv x2 (shared down), linear1
    again = load_file(back)
    assert set(again) == set(original)  # the same kohya names come back
    for k, v in original.items():
        assert torch.equal(again[k].to(v.dtype), v), k
    _assert_identical(_merged(model, str(src)), _merged(model, str(back)))


def test_diffusers_comfy_diffusers_round_trip(model, tmp_path, capsys):
    src = tmp_path / "diffusers.safetensors"
    original = diffusers_flux()
    save_file(original, src)
    comfy = tmp_path / "comfy.safetensors"
    assert (
        main(["convert", str(src), "--to", "comfy", "-o", str(comfy), "--json"]) == 2
    )  # no model: arch needed
    capsys.readouterr()
    res = convert(src, "comfy", comfy, target=model)
    assert res.joins == 2  # img qkv of block 1, linear1 of single block 1 (rank concatenation)
    csd = load_file(comfy)
    assert csd["diffusion_model.single_blocks.1.linear1.lora_down.weight"].shape == (16, H)
    assert csd["diffusion_model.double_blocks.1.img_attn.qkv.lora_up.weight"].shape == (3 * H, 12)
    assert "diffusion_model.final_layer.adaLN_modulation.1.lora_up.weight" in csd
    # Joined blocks of different parts add the same rows: merged weights agree to rounding.
    ref, joined = _merged(model, str(src)), _merged(model, str(comfy))
    for k in ref:
        assert torch.allclose(ref[k], joined[k], rtol=0, atol=1e-6), k
    back = tmp_path / "back.safetensors"
    convert(comfy, "diffusers", back, target=model)
    again = load_file(back)
    assert {k for k in again if not k.endswith(".alpha")} == set(original)
    for k, v in original.items():
        assert torch.equal(again[k], v), k
    _assert_identical(ref, _merged(model, str(back)))


def test_swap_scale_shift_rows(model, tmp_path):
    """final_layer.adaLN_modulation.1 rows are (shift, scale); diffusers norm_out.linear holds (scale,
    shift)."""
    sd = {}
    _pair(
        sd, "lora_unet_final_layer_adaLN_modulation_1", 2 * H, H, torch.Generator().manual_seed(5), alpha=4.0
    )
    save_file(sd, tmp_path / "k.safetensors")
    convert(tmp_path / "k.safetensors", "diffusers", tmp_path / "d.safetensors", target=model)
    out = load_file(tmp_path / "d.safetensors")
    up = sd["lora_unet_final_layer_adaLN_modulation_1.lora_up.weight"]
    expected = torch.cat([up[H:], up[:H]])  # written independently of the arch table
    assert torch.equal(out["transformer.norm_out.linear.lora_B.weight"], expected)


def test_refusals(model, tmp_path):
    lokr = {
        "lora_unet_double_blocks_0_img_attn_proj.lokr_w1": torch.randn(4, 4),
        "lora_unet_double_blocks_0_img_attn_proj.lokr_w2": torch.randn(8, 8),
    }
    save_file(lokr, tmp_path / "lokr.safetensors")
    # LoKr keeps its family only where the layout names its factors (kohya, comfy); elsewhere --rank is asked
    with pytest.raises(ConvertError, match="lokr.*--rank"):
        convert(tmp_path / "lokr.safetensors", "peft", tmp_path / "o1.safetensors", target=model)
    bad = kohya_flux()
    bad["lora_unet_nowhere.lora_down.weight"] = torch.zeros(2, 3)
    bad["lora_unet_nowhere.lora_up.weight"] = torch.zeros(3, 2)
    save_file(bad, tmp_path / "bad.safetensors")
    with pytest.raises(ConvertError, match="do not resolve"):
        convert(tmp_path / "bad.safetensors", "peft", tmp_path / "o2", target=model)
    assert not (tmp_path / "o1.safetensors").exists() and not (tmp_path / "o2").exists()


def test_real_files_convert_on_full_size_models(tmp_path):
    # cloneofsimo positional keys (UNet + CLIP) -> kohya names: needs the model's enumeration order.
    src = REALDATA / "lora" / "cloneofsimo__lora__analog_svd_rank4.safetensors"
    out = tmp_path / "kohya.safetensors"
    assert main(["convert", str(src), "--to", "kohya", "--arch", "sd1", "-o", str(out)]) == 0
    keys, source = load_file(out), load_file(src)
    for new, old in (
        ("lora_unet_", "unet:"),
        ("lora_te_", "text_encoder:"),
    ):  # down, up, alpha per positional layer
        assert sum(k.startswith(new) for k in keys) == 3 * sum(
            k.startswith(old) and k.endswith(":down") for k in source
        )
    with pytest.raises(ConvertError, match="one model"):
        convert(src, "peft", tmp_path / "p", arch="sd1")
    from loraweave.tools.inspect import inspect_adapter

    cov = inspect_adapter(out, arch="sd1")["coverage"]
    assert cov["keys_applied"] == cov["keys_total"] == 192 * 3
    # diffusers SD1 -> comfy (ldm names: input_blocks...) resolves back on the same model.
    src = REALDATA / "lora" / "timohavdk__sd-lora__2100-lora.safetensors"
    comfy = tmp_path / "comfy.safetensors"
    convert(src, "comfy", comfy, arch="sd1")
    names = load_file(comfy)
    assert any(k.startswith("diffusion_model.input_blocks.1.1.") for k in names)
    assert inspect_adapter(comfy, arch="sd1")["coverage"]["unmatched"] == []


@pytest.mark.parametrize("to", ["kohya", "comfy"])
def test_a_component_the_layout_has_no_prefix_for_is_refused_by_name(tmp_path, to):
    """MiniMax-H3's second partition (`transformer_ref`) has no kohya or comfy prefix: a typed ConvertError
    naming the file and the component, nothing written, the target untouched (was lora_te_, read back as a
    text encoder)."""
    parts = {"transformer": tiny_flux(seed=2), "transformer_ref": tiny_flux(seed=3)}
    before = {c: copy.deepcopy(m.state_dict()) for c, m in parts.items()}
    layer = parts["transformer_ref"].transformer_blocks[0].attn.to_q
    g = torch.Generator().manual_seed(5)
    src, out = tmp_path / "ref.safetensors", tmp_path / f"{to}.safetensors"
    save_file(
        {
            "transformer_ref.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(
                2, layer.in_features, generator=g
            ),
            "transformer_ref.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(
                layer.out_features, 2, generator=g
            ),
        },
        src,
    )
    with pytest.raises(ConvertError, match="no prefix for component transformer_ref") as err:
        convert(src, to, out, target=parts)
    assert str(src) in str(err.value) and not out.exists()
    assert all(torch.equal(before[c][k], v) for c, m in parts.items() for k, v in m.state_dict().items())
