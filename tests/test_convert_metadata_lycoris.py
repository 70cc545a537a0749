"""`convert` keeps the source's metadata (issue 42 item 2) and converts LoKr/LoHa (issue 42, beyond the
defects): as they are (bit-identical merges, equal to LyCORIS's own ΔW) or as LoRAs at a rank (the reported
energy is the Eckart-Young share: ||ΔW - ΔW_r||² = (1 - energy)·||ΔW||²).

Tolerances (fp32): as-is vs LyCORIS's `functional.*.diff_weight` ≤ 1e-6 of max|ΔW|; the rank case's residual
equals (1 - energy)·||ΔW||² to 1e-3 relative; a full rank truncation reproduces ΔW to 1e-5 of max|ΔW|."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from lycoris.functional.loha import diff_weight as loha_diff_weight
from lycoris.functional.lokr import diff_weight as lokr_diff_weight
from safetensors import safe_open
from safetensors.torch import save_file

import loraweave
from loraweave.cli import main
from loraweave.errors import ConvertError
from loraweave.formats.adapter import load_adapter
from loraweave.tools.convert import convert
from loraweave.tools.inspect_dir import trigger_words
from loraweave.tools.skeleton import CACHE_ENV

sys.path.insert(0, str(Path(__file__).parent))
from helpers.tiny_models import tiny_flux  # noqa: E402

H = 32
PROJ = "transformer_blocks.0.attn.to_out.0"  # BFL double_blocks.0.img_attn.proj
MLP = "transformer_blocks.0.ff.net.0.proj"  # BFL double_blocks.0.img_mlp.0
META = {
    "ss_tag_frequency": json.dumps({"10_falcon": {"smart falcon": 40, "1girl": 38, "solo": 12}}),
    "modelspec.trigger_phrase": "smart falcon",
    "modelspec.title": "Falcon",
    "ss_base_model_version": "flux1",
    "ss_training_comment": "trained for the test",
    "ss_network_dim": "4",
    "ss_network_alpha": "8.0",
    "ss_num_train_images": "40",
    "sshs_model_hash": "0" * 64,
    "sshs_legacy_hash": "1" * 8,
}


@pytest.fixture(autouse=True, scope="module")
def _skeleton_cache(tmp_path_factory):
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("skeletons"))
    yield
    os.environ.pop(CACHE_ENV) if old is None else os.environ.__setitem__(CACHE_ENV, old)


@pytest.fixture(scope="module")
def model():
    return tiny_flux(seed=3)


def _lora_file(path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {
        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": torch.randn(4, H, generator=g),
        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": torch.randn(H, 4, generator=g),
        "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(8.0),
    }
    save_file(sd, path, metadata=META)


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(path, "pt") as f:
        return f.metadata() or {}


@pytest.mark.parametrize("to", ["comfy", "diffusers"])
def test_convert_keeps_metadata_and_says_what_it_rewrote(model, tmp_path, to):
    src, out = tmp_path / "src.safetensors", tmp_path / "out.safetensors"
    _lora_file(src)
    res = convert(src, to, out, target=model)
    meta = _metadata(out)
    for key in ("ss_tag_frequency", "modelspec.trigger_phrase", "modelspec.title", "ss_base_model_version"):
        assert meta[key] == META[key], key
    assert meta["ss_training_comment"] == META["ss_training_comment"]
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "8.0"  # one module, rank kept
    assert "sshs_model_hash" not in meta and "sshs_legacy_hash" not in meta  # hashes of the source's bytes
    assert set(res.metadata_rewritten) == {"sshs_model_hash", "sshs_legacy_hash"}
    assert res.metadata_kept == len(META) - 2
    assert trigger_words(load_adapter(str(out)).metadata) == trigger_words(META)
    assert trigger_words(META)[:2] == ["smart falcon", "1girl"]


def test_inspect_of_the_converted_file_shows_the_trigger_words(model, tmp_path, capsys):
    src, out = tmp_path / "src.safetensors", tmp_path / "out.safetensors"
    _lora_file(src)
    convert(src, "kohya", out, target=model)
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    rows = {Path(r["file"]).name: r for r in (printed if isinstance(printed, list) else printed["files"])}
    assert rows["out.safetensors"]["trigger_words"] == rows["src.safetensors"]["trigger_words"]
    assert rows["out.safetensors"]["trigger_words"][0] == "smart falcon"


def _lycoris_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoKr on img_attn.proj and a LoHa on img_mlp.0, kohya names; (file tensors, LyCORIS ΔW by module)."""
    g = torch.Generator().manual_seed(7)
    k = "lora_unet_double_blocks_0_img_attn_proj"
    h = "lora_unet_double_blocks_0_img_mlp_0"
    sd = {
        f"{k}.lokr_w1": torch.randn(4, 4, generator=g),
        f"{k}.lokr_w2_a": torch.randn(8, 2, generator=g) * 0.3,
        f"{k}.lokr_w2_b": torch.randn(2, 8, generator=g) * 0.3,
        f"{k}.alpha": torch.tensor(1.5),
        f"{h}.hada_w1_a": torch.randn(4 * H, 4, generator=g) * 0.3,
        f"{h}.hada_w1_b": torch.randn(4, H, generator=g) * 0.3,
        f"{h}.hada_w2_a": torch.randn(4 * H, 4, generator=g) * 0.3,
        f"{h}.hada_w2_b": torch.randn(4, H, generator=g) * 0.3,
        f"{h}.alpha": torch.tensor(2.0),
    }
    save_file(sd, path, metadata={"ss_network_module": "lycoris.kohya", "ss_network_args": '{"algo": "x"}'})
    lokr = lokr_diff_weight(
        sd[f"{k}.lokr_w1"], None, None, None, sd[f"{k}.lokr_w2_a"], sd[f"{k}.lokr_w2_b"], None, gamma=1.5
    )
    loha = loha_diff_weight(
        sd[f"{h}.hada_w1_b"], sd[f"{h}.hada_w1_a"], sd[f"{h}.hada_w2_b"], sd[f"{h}.hada_w2_a"], None, None,
        gamma=2.0 / 4,
    )  # fmt: skip
    return sd, {PROJ: lokr, MLP: loha}


def _deltas(model, path: Path) -> dict[str, torch.Tensor]:
    m = copy.deepcopy(model)
    loraweave.apply(m, str(path), mode="merge", strict=True)
    weight = {n: model.get_submodule(n).weight.detach() for n in (PROJ, MLP)}
    return {n: m.get_submodule(n).weight.detach() - w for n, w in weight.items()}


@pytest.mark.parametrize("to", ["comfy", "kohya"])
def test_lokr_loha_as_they_are_equal_lycoris_delta(model, tmp_path, to):
    src, out = tmp_path / "lyco.safetensors", tmp_path / "out.safetensors"
    _, reference = _lycoris_file(src)
    res = convert(src, to, out, target=model)
    assert res.as_is == 2 and not res.lowrank
    with safe_open(out, "pt") as f:
        keys = set(f.keys())
    assert any(k.endswith(".lokr_w1") for k in keys) and any(k.endswith(".hada_w2_b") for k in keys)
    ours, before = _deltas(model, out), _deltas(model, src)
    for name, ref in reference.items():
        assert torch.equal(ours[name], before[name]), name  # the same factors, the same merge
        err = float((ours[name] - ref).abs().max() / ref.abs().max())
        assert err <= 1e-6, (name, err)


def test_lokr_loha_to_lora_at_a_rank_report_the_captured_energy(model, tmp_path, capsys):
    src = tmp_path / "lyco.safetensors"
    _, reference = _lycoris_file(src)
    with pytest.raises(ConvertError, match="--rank"):  # peft/diffusers name no LoKr factors
        convert(src, "diffusers", tmp_path / "no.safetensors", target=model)
    assert not (tmp_path / "no.safetensors").exists()
    out = tmp_path / "r3.safetensors"
    res = convert(src, "diffusers", out, target=model, rank=3)
    assert res.as_is == 0 and {la["rank"] for la in res.lowrank} == {3}
    meta = _metadata(out)
    assert meta["ss_network_module"] == "networks.lora" and "ss_network_args" not in meta
    ours = _deltas(model, out)
    by_family = {la["family"]: la["energy"] for la in res.lowrank}
    for name, family in ((PROJ, "lokr"), (MLP, "loha")):
        ref = reference[name].double()
        residual = float((ours[name].double() - ref).square().sum())
        expected = (1 - by_family[family]) * float(ref.square().sum())
        assert 0 < by_family[family] < 1
        assert residual == pytest.approx(expected, rel=1e-3), name
    full = tmp_path / "full.safetensors"
    convert(src, "comfy", full, target=model, rank=H)  # every singular value: exact to rounding
    exact = _deltas(model, full)
    for name, ref in reference.items():
        assert float((exact[name] - ref).abs().max() / ref.abs().max()) <= 1e-5, name


def test_real_lokr_file_as_it_is_with_its_metadata(realdata, tmp_path, capsys):
    """A real LyCORIS LoKr (SD1, conv layers, trained with kohya): comfy names, the same tensors, the
    training metadata (tag frequencies, the comment naming the trigger word) carried over."""
    src = realdata / "lora" / "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"
    out = tmp_path / "falcon_comfy.safetensors"
    assert main(["convert", str(src), "--to", "comfy", "-o", str(out), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["as_is"] == res["targets"] == 350 and res["keys_out"] == res["keys_in"] == 1750
    assert set(res["metadata_rewritten"]) == {"sshs_model_hash", "sshs_legacy_hash"}
    before, after = _metadata(src), _metadata(out)
    assert {k: after[k] for k in before if not k.startswith("sshs_")} == {
        k: v for k, v in before.items() if not k.startswith("sshs_")
    }
    with safe_open(src, "pt") as f, safe_open(out, "pt") as g:
        originals = sorted(f.get_tensor(k).flatten()[:4].tolist() for k in f.keys() if ".alpha" not in k)
        converted = sorted(g.get_tensor(k).flatten()[:4].tolist() for k in g.keys() if ".alpha" not in k)
        assert all(k.startswith(("diffusion_model.", "text_encoders.")) for k in g.keys())
    assert originals == converted
