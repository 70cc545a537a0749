"""`loraweave merge` (issue 42, beyond the defects): A:0.7 + B:0.5 written as one LoRA.

References: the same model with both sources applied by loraweave at their strengths (the sum), and the
Eckart-Young identity for the truncated case. Tolerances (fp32): exact concatenation ≤ 2e-6 absolute on
every merged weight (|W| ~ 0.2, ΔW ~ 1: fp32 rounding of two sums in different order); truncation: per
module ||ΔW_sum - ΔW_merged||² = (1 - energy)·||ΔW_sum||² to 1e-3 relative."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import loraweave
from loraweave.cli import main
from loraweave.errors import ArgumentError, MergeError
from loraweave.tools.merge import merge
from loraweave.tools.skeleton import CACHE_ENV

sys.path.insert(0, str(Path(__file__).parent))
from helpers.tiny_models import tiny_flux, tiny_sdxl_unet  # noqa: E402

H = 32


@pytest.fixture(autouse=True, scope="module")
def _skeleton_cache(tmp_path_factory):
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("skeletons"))
    yield
    os.environ.pop(CACHE_ENV) if old is None else os.environ.__setitem__(CACHE_ENV, old)


@pytest.fixture(scope="module")
def flux():
    return tiny_flux(seed=4)


def _pair(sd, stem, rows, cols, g, rank=4, alpha=None, peft=False, kernel=()):
    names = (".lora_A.weight", ".lora_B.weight") if peft else (".lora_down.weight", ".lora_up.weight")
    sd[stem + names[0]] = torch.randn(rank, cols, *kernel, generator=g) * 0.3
    sd[stem + names[1]] = torch.randn(rows, rank, *([1] * len(kernel)), generator=g) * 0.3
    if alpha is not None:
        sd[stem + ".alpha"] = torch.tensor(alpha)


def _sources(tmp_path: Path) -> tuple[Path, Path]:
    """A: kohya names (fused qkv, linear1, alphas != rank); B: diffusers names, an overlapping and a
    different layer set (to_q/to_k/to_v of block 0 meet A's qkv; ff only in B; linear2 only in A)."""
    g = torch.Generator().manual_seed(11)
    a: dict[str, torch.Tensor] = {}
    _pair(a, "lora_unet_double_blocks_0_img_attn_qkv", 3 * H, H, g, alpha=8.0)
    _pair(a, "lora_unet_single_blocks_0_linear1", 7 * H, H, g, rank=2, alpha=1.0)
    _pair(a, "lora_unet_single_blocks_1_linear2", H, 5 * H, g, alpha=2.0)
    b: dict[str, torch.Tensor] = {}
    for proj in ("to_q", "to_k", "to_v"):
        _pair(b, f"transformer.transformer_blocks.0.attn.{proj}", H, H, g, rank=3, peft=True)
    _pair(b, "transformer.transformer_blocks.0.ff.net.2", H, 4 * H, g, rank=6, peft=True)
    _pair(b, "transformer.single_transformer_blocks.0.proj_mlp", 4 * H, H, g, rank=2, peft=True)
    pa, pb = tmp_path / "A.safetensors", tmp_path / "B.safetensors"
    save_file(a, pa, metadata={"modelspec.trigger_phrase": "falcon", "ss_base_model_version": "flux1"})
    save_file(b, pb, metadata={"modelspec.trigger_phrase": "ocean", "ss_base_model_version": "flux1"})
    return pa, pb


def _weights(model, adapters) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    loraweave.apply(m, adapters, mode="merge", strict=True)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("to", ["kohya", "diffusers"])
def test_concatenation_applies_as_the_sum(flux, tmp_path, to):
    a, b = _sources(tmp_path)
    out = tmp_path / "AB.safetensors"
    res = merge([(a, 0.7), (b, 0.5)], out, to=to, target=flux)
    assert res.exact and {la["energy"] for la in res.layers} == {1.0}
    summed, merged = _weights(flux, [(str(a), 0.7), (str(b), 0.5)]), _weights(flux, str(out))
    changed = [k for k in summed if not torch.equal(summed[k], flux.state_dict()[k])]
    assert len(changed) >= 9  # q, k, v, linear1, linear2, ff, proj_mlp... all reached
    for k in summed:
        assert torch.allclose(merged[k], summed[k], rtol=0, atol=2e-6), k
    with safe_open(out, "pt") as f:
        meta = f.metadata()
    record = json.loads(meta["loraweave.merged"])
    assert record["sources"] == [
        {"file": "A.safetensors", "strength": 0.7},
        {"file": "B.safetensors", "strength": 0.5},
    ]
    assert meta["modelspec.trigger_phrase"] == "falcon, ocean" and meta["ss_base_model_version"] == "flux1"


def test_rank_truncation_reports_the_captured_energy(flux, tmp_path):
    a, b = _sources(tmp_path)
    out = tmp_path / "AB2.safetensors"
    res = merge([(a, 0.7), (b, -0.5)], out, to="diffusers", rank=2, target=flux)
    assert not res.exact
    summed, merged = _weights(flux, [(str(a), 0.7), (str(b), -0.5)]), _weights(flux, str(out))
    base = flux.state_dict()
    truncated = 0
    for la in res.layers:
        key = la["name"].removeprefix("transformer.") + ".weight"
        want = (summed[key] - base[key]).double()
        got = (merged[key] - base[key]).double()
        residual = float((want - got).square().sum())
        assert la["rank"] <= 2
        assert residual == pytest.approx((1 - la["energy"]) * float(want.square().sum()), rel=1e-3, abs=1e-9)
        truncated += la["energy"] < 1
    assert truncated >= 3


def test_conv_layers_concatenate_exactly(tmp_path):
    unet = tiny_sdxl_unet(seed=1)
    g = torch.Generator().manual_seed(3)
    a: dict[str, torch.Tensor] = {}
    b: dict[str, torch.Tensor] = {}
    conv = "unet.down_blocks.0.resnets.0.conv1"  # 16 -> 16, 3x3
    _pair(a, conv, 16, 16, g, rank=2, peft=True, kernel=(3, 3))
    _pair(b, conv, 16, 16, g, rank=3, peft=True, kernel=(3, 3))
    _pair(b, "unet.down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k", 32, 32, g, peft=True)
    save_file(a, tmp_path / "ca.safetensors")
    save_file(b, tmp_path / "cb.safetensors")
    out = tmp_path / "conv.safetensors"
    res = merge([(tmp_path / "ca.safetensors", 0.7), (tmp_path / "cb.safetensors", 0.5)], out, target=unet)
    with safe_open(out, "pt") as f:
        downs = {k: f.get_slice(k).get_shape() for k in f.keys() if k.endswith("lora_down.weight")}
    assert any(shape == [5, 16, 3, 3] for shape in downs.values()), downs  # ranks 2 + 3, kernel kept
    assert res.exact
    ca, cb = str(tmp_path / "ca.safetensors"), str(tmp_path / "cb.safetensors")
    summed = _weights(unet, [(ca, 0.7), (cb, 0.5)])
    merged = _weights(unet, str(out))
    for k in summed:
        assert torch.allclose(merged[k], summed[k], rtol=0, atol=2e-6), k


def test_bad_inputs_are_refused_by_file_and_field_nothing_written(flux, tmp_path):
    a, b = _sources(tmp_path)
    out = tmp_path / "o.safetensors"
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        merge([(a, 0.7), (tmp_path / "missing.safetensors", 0.5)], out, target=flux)
    with pytest.raises(ArgumentError, match="B.safetensors: strength"):
        merge([(a, 0.7), (b, float("nan"))], out, target=flux)
    g = torch.Generator().manual_seed(0)
    sdxl: dict[str, torch.Tensor] = {}
    _pair(sdxl, "lora_unet_input_blocks_4_1_proj_in", 640, 640, g)
    save_file(sdxl, tmp_path / "sdxl.safetensors")
    with pytest.raises(MergeError, match="sdxl.safetensors: key lora_unet_input_blocks_4_1_proj_in"):
        merge([(a, 0.7), (tmp_path / "sdxl.safetensors", 0.5)], out, target=flux)
    wide: dict[str, torch.Tensor] = {}
    _pair(wide, "lora_unet_single_blocks_1_linear2", H, 3 * H, g)  # linear2 takes 5H columns
    save_file(wide, tmp_path / "wide.safetensors")
    with pytest.raises(MergeError, match="wide.safetensors: key lora_unet_single_blocks_1_linear2"):
        merge([(a, 0.7), (tmp_path / "wide.safetensors", 0.5)], out, target=flux)
    lokr = {
        "lora_unet_double_blocks_0_img_attn_proj.lokr_w1": torch.randn(4, 4, generator=g),
        "lora_unet_double_blocks_0_img_attn_proj.lokr_w2": torch.randn(8, 8, generator=g),
    }
    save_file(lokr, tmp_path / "lokr.safetensors")
    with pytest.raises(ArgumentError, match="lokr.safetensors: lokr part .*--rank"):
        merge([(a, 0.7), (tmp_path / "lokr.safetensors", 0.5)], out, target=flux)
    assert not out.exists()
    res = merge([(a, 0.7), (tmp_path / "lokr.safetensors", 0.5)], out, target=flux, rank=4)
    assert not res.exact and out.exists()  # with --rank: the LoKr joins as its truncated SVD


def test_cli_refusals_and_help(tmp_path, capsys):
    a, b = _sources(tmp_path)
    out = tmp_path / "AB.safetensors"
    with pytest.raises(SystemExit) as exc:
        main(["merge", f"{a}:0.7", f"{b}:inf", "-o", str(out)])
    assert exc.value.code == 2 and "B.safetensors" in capsys.readouterr().err
    out.write_bytes(b"mine")
    assert main(["merge", f"{a}:0.7", f"{b}:0.5", "-o", str(out), "--arch", "flux"]) == 2
    assert "--force" in capsys.readouterr().err and out.read_bytes() == b"mine"
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = capsys.readouterr().out
    assert "FILE[:STRENGTH]" in text and "--rank" in text and "captured" in text and "exit status" in text


def test_real_files_merge_by_detection_and_refuse_another_architecture(realdata, tmp_path, capsys):
    lora = realdata / "lora"
    sd15 = lora / "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors"
    haseebae = "Haseebae__Synthetic_dataset_generator_with_stable_diffusion"
    sd1 = lora / f"{haseebae}__pytorch_lora_weights.safetensors"
    sd2 = lora / "JustinJiangNext__lora-2.0__pytorch_lora_weights.safetensors"
    out = tmp_path / "m.safetensors"
    assert main(["merge", f"{sd15}:0.7", f"{sd1}:0.5", "-o", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["exact"] and res["targets"] == 128 and {la["rank"] for la in res["layers"]} == {8}  # 4 + 4
    assert [s["strength"] for s in res["sources"]] == [0.7, 0.5]
    bad = tmp_path / "bad.safetensors"
    with pytest.raises(MergeError, match="different architectures.*JustinJiangNext.*sd2"):
        merge([(sd15, 0.7), (sd2, 0.5)], bad)
    assert not bad.exists()
