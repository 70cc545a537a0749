"""`extract` and `resize`: captured energy, optimality against an SVD written here, and the merged result."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import loraweave
from loraweave.cli import main
from loraweave.tools.extract import extract
from loraweave.tools.resize import resize
from loraweave.tools.skeleton import CACHE_ENV


@pytest.fixture(autouse=True, scope="module")
def _skeleton_cache(tmp_path_factory):
    """Architecture skeletons cached in a temp folder, never in the user's home."""
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("skeletons"))
    yield
    os.environ.pop(CACHE_ENV) if old is None else os.environ.__setitem__(CACHE_ENV, old)


def _lowrank(rows: int, cols: int, rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, rank, generator=g, dtype=torch.float64)
        @ torch.randn(rank, cols, generator=g, dtype=torch.float64)
        * 0.05
    )


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(48, 64)
        self.b = torch.nn.Conv2d(16, 32, 3)
        self.c = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)


@pytest.fixture()
def checkpoints(tmp_path):
    torch.manual_seed(0)
    base = Tiny()
    sd = {k: v.detach().clone() for k, v in base.state_dict().items()}
    tuned = dict(sd)
    tuned["a.weight"] = (sd["a.weight"].double() + _lowrank(64, 48, 8, 1)).float()
    tuned["b.weight"] = (sd["b.weight"].double() + _lowrank(32, 16 * 9, 8, 2).reshape(32, 16, 3, 3)).float()
    tuned["norm.weight"] = sd["norm.weight"] + 0.1
    save_file(sd, tmp_path / "base.safetensors")
    save_file(tuned, tmp_path / "tuned.safetensors")
    return tmp_path, base, tuned


def test_extract_known_rank8_difference(checkpoints, capsys):
    root, base, tuned = checkpoints
    out = root / "lora.safetensors"
    assert (
        main(
            [
                "extract",
                str(root / "base.safetensors"),
                str(root / "tuned.safetensors"),
                "--rank",
                "8",
                "-o",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert [la["name"] for la in res["layers"]] == ["diffusion_model.a", "diffusion_model.b"]
    assert res["energy_min"] >= 0.999999 and all(la["rank"] == 8 for la in res["layers"])
    assert res["skipped"] == {"unchanged": 5, "1-D or non-weight tensor differs (not expressible as LoRA)": 1}
    lora = load_file(out)
    assert lora["diffusion_model.b.lora_down.weight"].shape == (8, 16, 3, 3)
    # Applied back onto the base (through the library's merge), it reproduces the tuned weights.
    handle = loraweave.apply(base, str(out), mode="merge", strict=True)
    assert handle.report.keys_applied == 6
    for name in ("a.weight", "b.weight"):
        err = (base.state_dict()[name] - tuned[name]).abs().max().item()
        assert err < 2e-6, (name, err)


def test_extract_energy_threshold_picks_rank(tmp_path):
    s = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(40, 6, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(30, 6, generator=g, dtype=torch.float64))
    delta = (u * s) @ v.T
    base = torch.randn(40, 30, generator=g)
    save_file({"x.weight": base}, tmp_path / "b.safetensors")
    save_file({"x.weight": (base.double() + delta).float()}, tmp_path / "t.safetensors")
    for energy in (0.9, 0.99, 0.999):
        share = torch.cumsum(s**2, 0) / (s**2).sum()
        want = int((share < energy).sum()) + 1  # smallest r with share[r-1] >= energy
        res = extract(
            tmp_path / "b.safetensors",
            tmp_path / "t.safetensors",
            tmp_path / f"{energy}.safetensors",
            energy=energy,
        )
        assert res.layers[0]["rank"] == want
        assert res.layers[0]["energy"] == pytest.approx(float(share[want - 1]), abs=1e-6)
    capped = extract(
        tmp_path / "b.safetensors",
        tmp_path / "t.safetensors",
        tmp_path / "c.safetensors",
        energy=0.999,
        rank=2,
    )
    assert capped.layers[0]["rank"] == 2


def _best_error(delta: torch.Tensor, rank: int) -> float:
    s = torch.linalg.svdvals(delta.double())
    return float((s[rank:] ** 2).sum().sqrt())


def _lora_delta(sd: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    down = sd[f"{stem}.lora_down.weight"].double().flatten(1)
    up = sd[f"{stem}.lora_up.weight"].double().flatten(1)
    return up @ down * (float(sd[f"{stem}.alpha"]) / down.shape[0])


def test_resize_lokr_matches_best_rank_r(tmp_path, capsys):
    g = torch.Generator().manual_seed(4)
    w1 = torch.randn(4, 4, generator=g)
    w2a, w2b = torch.randn(16, 6, generator=g), torch.randn(6, 12, generator=g)
    lokr = {
        "lora_unet_x.lokr_w1": w1,
        "lora_unet_x.lokr_w2_a": w2a,
        "lora_unet_x.lokr_w2_b": w2b,
        "lora_unet_x.alpha": torch.tensor(3.0),
    }
    # LoRA of rank 16 and a full diff, resized in the same file.
    lora = {
        "lora_unet_y.lora_down.weight": torch.randn(16, 20, generator=g),
        "lora_unet_y.lora_up.weight": torch.randn(24, 16, generator=g),
        "lora_unet_y.alpha": torch.tensor(8.0),
    }
    full = {"lora_unet_z.diff": torch.randn(10, 12, generator=g)}
    save_file({**lokr, **lora, **full}, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    assert main(["resize", str(tmp_path / "in.safetensors"), "--rank", "5", "-o", str(out)]) == 0
    assert "captured energy per layer: min" in capsys.readouterr().out
    sd = load_file(out)
    references = {
        "lora_unet_x": torch.kron(w1.double(), w2a.double() @ w2b.double())
        * (3.0 / 6),  # γ = alpha / w2 rank
        "lora_unet_y": lora["lora_unet_y.lora_up.weight"].double()
        @ lora["lora_unet_y.lora_down.weight"].double()
        * (8.0 / 16),
        "lora_unet_z": full["lora_unet_z.diff"].double(),
    }
    for stem, ref in references.items():
        ours = _lora_delta(sd, stem)
        assert sd[f"{stem}.lora_down.weight"].shape[0] == 5
        err, best = float((ref - ours).norm()), _best_error(ref, 5)
        assert abs(err - best) <= 1e-3 * best, (stem, err, best)


def test_resize_refuses_families_needing_base(tmp_path):
    sd = {
        "lora_unet_x.oft_blocks": torch.zeros(2, 4, 4),
        "lora_unet_x.alpha": torch.tensor(0.0),
        "lora_unet_y.lora_down.weight": torch.randn(4, 8),
        "lora_unet_y.lora_up.weight": torch.randn(8, 4),
    }
    save_file(sd, tmp_path / "in.safetensors")
    res = resize(tmp_path / "in.safetensors", tmp_path / "out.safetensors", rank=2)
    assert [la["name"] for la in res.layers] == ["lora_unet_y"]
    assert list(res.skipped.values()) == [2] and "oft" in next(iter(res.skipped))


@pytest.mark.parametrize(
    "alpha", [torch.tensor(float("inf")), torch.tensor([2.0, 2.0])], ids=["inf", "vector"]
)
def test_resize_settles_alpha_as_apply_does(tmp_path, alpha):
    """resize reads a part's scale through the planner's part_scale: a non-finite or non-scalar alpha is the
    part's miss (as apply reports it), never NaN factors in the output or an untyped error."""
    g = torch.Generator().manual_seed(3)
    sd = {
        "lora_unet_x.lora_down.weight": torch.randn(4, 8, generator=g),
        "lora_unet_x.lora_up.weight": torch.randn(8, 4, generator=g),
        "lora_unet_x.alpha": alpha,
        "lora_unet_y.lora_down.weight": torch.randn(4, 8, generator=g),
        "lora_unet_y.lora_up.weight": torch.randn(8, 4, generator=g),
        "lora_unet_y.alpha": torch.tensor(2.0),
    }
    save_file(sd, tmp_path / "in.safetensors")
    res = resize(tmp_path / "in.safetensors", tmp_path / "out.safetensors", rank=2)
    assert [la["name"] for la in res.layers] == ["lora_unet_y"]
    (reason,) = res.skipped
    assert reason.startswith("unreadable part: bad tensor: lora_unet_x.alpha ")
    out = load_file(tmp_path / "out.safetensors")
    assert all(torch.isfinite(t).all() for t in out.values())


def test_resize_real_lokr_lands_on_sd1(tmp_path):
    src = (
        loraweave.load_adapter.__globals__["Path"](__file__).resolve().parents[2]
        / "shared"
        / "realdata"
        / "lora"
    )
    res = resize(
        src / "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors", tmp_path / "r.safetensors", rank=4
    )
    assert len(res.layers) == 350 and not res.skipped and 0 < res.energy_min <= res.energy_median <= 1
    from loraweave.tools.inspect import inspect_adapter

    cov = inspect_adapter(tmp_path / "r.safetensors", arch="sd1")["coverage"]
    assert cov["keys_total"] == 350 * 3 == cov["keys_applied"]
