"""`loraweave inspect`: layout, architecture with evidence, and coverage against full-size meta models or a
checkpoint."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from loraweave.arch.aliases import AliasTable
from loraweave.arch.catalog import build_meta
from loraweave.cli import main
from loraweave.tools.inspect import inspect_adapter
from loraweave.tools.skeleton import CACHE_ENV, describe, rebuild, skeleton

sys.path.insert(0, str(Path(__file__).parent))
from helpers.inspect_expected import EXPECTED
from helpers.tiny_models import tiny_flux  # noqa: E402

REALDATA = Path(__file__).resolve().parents[2] / "shared" / "realdata"


@pytest.fixture(autouse=True, scope="module")
def _skeleton_cache(tmp_path_factory):
    """Architecture skeletons cached in a temp folder, never in the user's home."""
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("skeletons"))
    yield
    os.environ.pop(CACHE_ENV) if old is None else os.environ.__setitem__(CACHE_ENV, old)


def _same_linears(real: torch.nn.Module, rebuilt: torch.nn.Module) -> None:
    """Every plain nn.Linear comes back as one (built without its constructor): same features, parameters,
    repr."""
    got = dict(rebuilt.named_modules())
    linears = [(p, m) for p, m in real.named_modules() if type(m) is torch.nn.Linear]
    assert linears
    for path, m in linears:
        r = got[path]
        assert type(r) is torch.nn.Linear and repr(r) == repr(m), path
        assert (r.in_features, r.out_features) == (m.in_features, m.out_features), path
        for name in ("weight", "bias"):
            a, b = getattr(m, name), getattr(r, name)
            assert (a is None) == (b is None), (path, name)
            if a is not None:
                assert (b.shape, b.dtype, b.device.type, b.requires_grad) == (
                    a.shape,
                    a.dtype,
                    "meta",
                    a.requires_grad,
                ), (path, name)


@pytest.mark.parametrize("arch", ["sd1", "flux", "sd3"])
def test_skeleton_resolves_like_the_real_model(arch):
    """The cached description rebuilds a tree the planner cannot tell from the diffusers model."""
    real = build_meta(arch)
    rebuilt = {c: rebuild(json.loads(json.dumps(describe(m)))) for c, m in real.items()}
    for comp in real:
        a, b = AliasTable(real[comp]), AliasTable(rebuilt[comp])
        assert a.exact == b.exact and a.underscored == b.underscored, comp
        classes = ("CrossAttention", "Attention", "GEGLU", "CLIPAttention")
        assert a.positional(classes) == b.positional(classes), comp
        _same_linears(real[comp], rebuilt[comp])
    assert skeleton(arch).keys() == real.keys()  # first call writes the cache
    cached = skeleton(arch)  # second call reads it
    assert AliasTable(cached[next(iter(cached))]).exact == AliasTable(real[next(iter(real))]).exact


def test_check_values_rejects_nan(tmp_path):
    path = REALDATA / "lora" / "leighwoods__public-loras__lora.safetensors"
    sd = load_file(path)
    key = next(k for k in sd if k.endswith("lora_A.weight"))
    sd[key][0, 0] = float("nan")
    save_file(sd, tmp_path / "nan.safetensors")
    assert inspect_adapter(tmp_path / "nan.safetensors")["coverage"]["keys_applied"] == 8  # shapes only
    cov = inspect_adapter(tmp_path / "nan.safetensors", check_values=True)["coverage"]
    assert cov["keys_applied"] == 6 and cov["unmatched_by_kind"] == {"non_finite": 2}


def test_every_real_file_is_listed():
    assert sorted(p.name for p in (REALDATA / "lora").glob("*.safetensors")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_inspect_real_file(name, capsys):
    path = REALDATA / "lora" / name
    assert main(["inspect", "--json", "--strict", str(path)]) == 0  # --strict: every key lands
    info = json.loads(capsys.readouterr().out)
    layout, arch = EXPECTED[name]
    assert info["layout"] == layout
    assert info["architecture"]["name"] == arch and info["architecture"]["evidence"]
    header_keys = (
        len(json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])) - 1
    )
    cov = info["coverage"]
    assert cov["keys_total"] == header_keys == cov["keys_applied"] and cov["unmatched"] == []
    assert sum(info["families"].values()) == info["parts"] > 0


def test_flux_file_saying_sd15_is_flux_with_evidence(capsys):
    path = REALDATA / "lora" / "leighwoods__public-loras__lora.safetensors"
    info = inspect_adapter(path)
    assert info["metadata"]["ss_base_model_version"] == "sd_1.5"
    assert info["architecture"]["name"] == "flux"
    evidence = " | ".join(info["architecture"]["evidence"])
    assert "4 of 4 parts match flux" in evidence and "disagrees; keys win" in evidence
    assert info["ranks"] == {"16": 4} and info["dtypes"] == {"float16": 8}
    assert "flux (full size, meta device)" in info["coverage"]["against"]
    assert main(["inspect", str(path)]) == 0  # readable table
    table = capsys.readouterr().out
    assert "architecture" in table and "flux" in table and "8/8 keys land" in table


def test_unet_kind_from_shapes_for_lokr():
    info = inspect_adapter(REALDATA / "lora" / "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr.safetensors")
    fit = info["architecture"]["evidence"][-1]
    assert fit.startswith("shapes fit sd1: 1750/1750") and fit.endswith("-> sd1")
    assert info["alphas"] == {"8": 350} and info["coverage"]["alpha_sources"] == {"tensor:alpha": 350}


def test_arch_override_reports_reasons_and_strict_exit(capsys):
    path = REALDATA / "lora" / "timohavdk__sd-lora__2100-lora.safetensors"
    assert main(["inspect", "--json", "--arch", "sdxl", "--no-text-encoders", str(path)]) == 0
    info = json.loads(capsys.readouterr().out)
    cov = info["coverage"]
    assert cov["keys_applied"] + len(cov["unmatched"]) == cov["keys_total"] == 256
    assert cov["keys_applied"] < 256 and set(cov["unmatched_by_kind"]) <= {"no_such_module", "shape_mismatch"}
    assert main(["inspect", "--strict", "--arch", "sdxl", "--no-text-encoders", str(path)]) == 1


def test_model_checkpoint_coverage(tmp_path, capsys):
    model = tiny_flux(seed=0)
    model.save_pretrained(tmp_path / "transformer", max_shard_size="80KB", safe_serialization=True)
    g = torch.Generator().manual_seed(0)
    lora = {
        "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.randn(4, 32, generator=g),
        "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.randn(96, 4, generator=g),
        "lora_unet_double_blocks_0_img_attn_qkv.alpha": torch.tensor(4.0),
        # wrong width: 48 input columns on a 32-wide layer
        "transformer.single_transformer_blocks.0.proj_out.lora_A.weight": torch.randn(4, 48, generator=g),
        "transformer.single_transformer_blocks.0.proj_out.lora_B.weight": torch.randn(32, 4, generator=g),
        "transformer.single_transformer_blocks.9.proj_out.lora_A.weight": torch.randn(4, 32, generator=g),
        "transformer.single_transformer_blocks.9.proj_out.lora_B.weight": torch.randn(32, 4, generator=g),
    }
    save_file(lora, tmp_path / "l.safetensors")
    assert (
        main(["inspect", "--json", "--model", str(tmp_path / "transformer"), str(tmp_path / "l.safetensors")])
        == 0
    )
    cov = json.loads(capsys.readouterr().out)["coverage"]
    assert cov["keys_total"] == 7 and cov["keys_applied"] == 3
    reasons = {u["key"]: u["reason"] for u in cov["unmatched"]}
    assert reasons["transformer.single_transformer_blocks.0.proj_out.lora_A.weight"].startswith(
        "shape mismatch"
    )
    assert reasons["transformer.single_transformer_blocks.9.proj_out.lora_B.weight"].startswith(
        "no such module"
    )
    assert cov["unmatched_by_kind"] == {"shape_mismatch": 2, "no_such_module": 2}


def test_unknown_architecture_still_reports_coverage(tmp_path, capsys):
    save_file(
        {"foo.bar.lora_down.weight": torch.zeros(2, 3), "foo.bar.lora_up.weight": torch.zeros(3, 2)},
        tmp_path / "x.safetensors",
    )
    assert main(["inspect", "--json", "--strict", str(tmp_path / "x.safetensors")]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["architecture"]["name"] == "unknown" and info["coverage"]["keys_applied"] == 0
    assert len(info["coverage"]["unmatched"]) == 2 and "--arch" in info["coverage"]["unmatched"][0]["reason"]


@pytest.mark.parametrize(
    "cmd,phrase",
    [
        ("inspect", "coverage {keys_total, keys_applied, unmatched}"),
        ("bake", "renamed into place"),
        ("convert", "rank concatenation"),
        ("extract", "captured energy per layer"),
        ("resize", "QR of the factors"),
    ],
)
def test_help_texts(cmd, phrase, capsys):
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    assert phrase in " ".join(capsys.readouterr().out.split())  # argparse re-wraps the description


def test_truncated_real_file_is_a_clean_error(capsys):
    path = (
        REALDATA
        / "lora"
        / "broken"
        / "Srikanth1408__Stable_Diffusion-Hackathon__pytorch_lora_weights__TRUNCATED.safetensors"
    )
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraweave: error:") and "truncated" in err


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    path = REALDATA / "lora" / "leighwoods__public-loras__lora.safetensors"
    assert main(["inspect", "--arch", "nope", str(path)]) == 2
    assert "unknown architecture 'nope'" in capsys.readouterr().err
    assert (
        main(["resize", str(path), "-o", str(tmp_path / "r.safetensors")]) == 2
    )  # neither --rank nor --energy
    assert "--rank" in capsys.readouterr().err and not (tmp_path / "r.safetensors").exists()
