"""`inspect FILE --plot` (per block x module kind ‖ΔW‖ heatmap) and `inspect DIR` (one row per adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.inspect_expected import EXPECTED
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loraweave.cli import main
from loraweave.tools.heatmap import EMPTY, RAMP, colour

SD1_SLOTS = ["BASE", *(f"IN{i:02d}" for i in range(12)), "M00", *(f"OUT{i:02d}" for i in range(12))]


def _lora(
    g, rows: int, cols: int, rank: int, kernel: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    down = torch.randn(rank, cols, *kernel, generator=g)
    up = torch.randn(rows, rank, *((1,) * len(kernel)), generator=g)
    return down, up


def _sd1_file(path: Path) -> dict[tuple[str, str], float]:
    """A kohya SD1 file (LoRA, LoCon conv, LoHa, TE) and its expected cells, ‖ΔW‖ computed here in float64."""
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    expected: dict[tuple[str, str], float] = {}
    loras = [  # (kohya name, out, in, rank, alpha, kernel, cell)
        (
            "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
            320,
            320,
            4,
            2.0,
            (),
            ("IN01", "attn1.to_q"),
        ),
        ("lora_unet_down_blocks_0_attentions_0_proj_in", 320, 320, 8, 8.0, (1, 1), ("IN01", "proj_in")),
        ("lora_unet_down_blocks_0_resnets_0_conv1", 320, 320, 4, 1.0, (3, 3), ("IN01", "conv1")),
        (
            "lora_unet_mid_block_attentions_0_transformer_blocks_0_ff_net_2",
            1280,
            5120,
            4,
            4.0,
            (),
            ("M00", "ff.net.2"),
        ),
        (
            "lora_unet_up_blocks_3_attentions_2_transformer_blocks_0_attn2_to_k",
            320,
            768,
            16,
            4.0,
            (),
            ("OUT11", "attn2.to_k"),
        ),
        (
            "lora_te_text_model_encoder_layers_3_self_attn_q_proj",
            768,
            768,
            4,
            4.0,
            (),
            ("text_encoder.L03", "self_attn.q_proj"),
        ),
    ]
    for name, out, inp, rank, alpha, kernel, cell in loras:
        down, up = _lora(g, out, inp, rank, kernel)
        sd |= {
            f"{name}.lora_down.weight": down,
            f"{name}.lora_up.weight": up,
            f"{name}.alpha": torch.tensor(alpha),
        }
        delta = up.double().flatten(1) @ down.double().flatten(1) * (alpha / rank)
        expected[cell] = float(delta.norm())
    name = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_k"  # LoHa: dense ΔW path
    w = {
        k: torch.randn(*s, generator=g) * 0.1
        for k, s in {
            "hada_w1_a": (640, 4),
            "hada_w1_b": (4, 640),
            "hada_w2_a": (640, 4),
            "hada_w2_b": (4, 640),
        }.items()
    }
    sd |= {f"{name}.{k}": v for k, v in w.items()} | {f"{name}.alpha": torch.tensor(2.0)}
    loha = (w["hada_w1_a"].double() @ w["hada_w1_b"].double()) * (
        w["hada_w2_a"].double() @ w["hada_w2_b"].double()
    )
    expected[("IN04", "attn1.to_k")] = float(loha.norm()) * 2.0 / 4
    sd["lora_unet_no_such_layer.lora_down.weight"] = torch.zeros(4, 8)
    sd["lora_unet_no_such_layer.lora_up.weight"] = torch.zeros(8, 4)
    save_file(sd, path)
    return expected


def _plot_chunk(path: Path) -> dict:
    return json.loads(Image.open(path).text["loraweave.plot"])


def _check_pixels(png: Path, data: dict) -> None:
    img = Image.open(png).convert("RGB")
    geo = data["geometry"]
    for i, row in enumerate(data["values"]):
        for j, v in enumerate(row):
            x = geo["x0"] + geo["cell_w"] * j + geo["cell_w"] // 2 - 1
            y = geo["y0"] + geo["cell_h"] * i + geo["cell_h"] // 2 - 1
            want = EMPTY if v is None else colour(v / geo["vmax"])
            assert img.getpixel((x, y)) == tuple(want), (data["rows"][i], data["columns"][j])


def test_plot_cells_match_block_norms(tmp_path, capsys):
    expected = _sd1_file(tmp_path / "sd1.safetensors")
    out = tmp_path / "plot.png"
    assert main(["inspect", str(tmp_path / "sd1.safetensors"), "--plot", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    data = _plot_chunk(out)
    assert info["plot"]["values"] == data["values"] and data["architecture"] == "sd1"
    assert data["rows"] == [*SD1_SLOTS, "text_encoder.L03"]  # SD1's own block order, every slot shown
    got = {
        (r, c): v
        for r, vals in zip(data["rows"], data["values"], strict=True)
        for c, v in zip(data["columns"], vals, strict=True)
        if v is not None
    }
    assert got.keys() == expected.keys()
    for cell, value in expected.items():
        assert got[cell] == pytest.approx(value, rel=1e-6), cell
    assert [s["key"] for s in data["skipped"]] == [
        "lora_unet_no_such_layer.lora_down.weight",
        "lora_unet_no_such_layer.lora_up.weight",
    ]
    _check_pixels(out, data)
    top = max(got, key=got.get)
    cell = data["rows"].index(top[0]), data["columns"].index(top[1])
    geo = data["geometry"]
    assert (
        Image.open(out)
        .convert("RGB")
        .getpixel((geo["x0"] + geo["cell_w"] * cell[1] + 5, geo["y0"] + geo["cell_h"] * cell[0] + 5))
        == RAMP[-1]
    )


def test_plot_energy_of_a_real_flux_file(realdata, tmp_path):
    """The real 4-layer Flux LoRA (no alpha: scale 1): energy shares from ‖B·A‖² of the file's own tensors."""
    path = realdata / "lora" / "leighwoods__public-loras__lora.safetensors"
    sd = load_file(path)
    sq = {}
    for key in sd:
        if key.endswith("lora_A.weight"):
            block = int(key.split(".")[2])
            delta = sd[key.replace("lora_A", "lora_B")].double() @ sd[key].double()
            sq[f"S{block:02d}"] = float(delta.square().sum())
    out = tmp_path / "flux.png"
    assert main(["inspect", str(path), "--plot", str(out), "--metric", "energy"]) == 0
    data = _plot_chunk(out)
    assert data["columns"] == ["proj_out"] and len(data["rows"]) == 1 + 19 + 38  # BASE, D00-D18, S00-S37
    got = {r: v[0] for r, v in zip(data["rows"], data["values"], strict=True) if v[0] is not None}
    total = sum(sq.values())
    assert got.keys() == sq.keys()
    for row, value in sq.items():
        assert got[row] == pytest.approx(value / total, rel=1e-6)
    _check_pixels(out, data)


def _all_real_files(realdata: Path) -> list[str]:
    return sorted(str(p.relative_to(realdata / "lora")) for p in (realdata / "lora").rglob("*.safetensors"))


def _top_tags(path: Path) -> list[str]:
    with safe_open(path, "pt") as f:
        freq = json.loads((f.metadata() or {}).get("ss_tag_frequency", "{}"))
    counts: dict[str, int] = {}
    for tags in freq.values():
        for tag, n in tags.items():
            counts[tag.strip()] = counts.get(tag.strip(), 0) + n
    return [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))][:10]


def test_inspect_dir_covers_every_real_file(realdata, capsys):
    folder = realdata / "lora"
    assert main(["inspect", str(folder), "--json"]) == 2  # broken/ holds a truncated file: an input error
    rows = json.loads(capsys.readouterr().out)
    assert [r["file"] for r in rows] == _all_real_files(realdata)
    for row in rows:
        name = Path(row["file"]).name
        if row["file"].startswith("broken/"):
            assert "truncated" in row["error"] and "Error:" not in row["error"]  # the message, no class name
            continue
        layout, arch = EXPECTED[name]
        assert (row["layout"], row["architecture"]["name"]) == (layout, arch), name
        assert row["coverage"]["complete"] and row["coverage"]["keys_applied"] == row["keys_total"], name
        assert row["families"] and row["rank"] == (
            8 if "falcon_8" in name else 16 if "leighwoods" in name else 4
        )
        assert row["trigger_words"] == _top_tags(folder / row["file"]), name
    by_name = {Path(r["file"]).name: r for r in rows}
    assert by_name["leighwoods__public-loras__lora.safetensors"]["trigger_words"] == ["YEW"]
    # Summed over its three datasets: the character tag 130, "hair bow" 129.
    assert by_name["KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"]["trigger_words"][:2] == [
        "smart falcon \\(umamusume\\)",
        "hair bow",
    ]


def test_inspect_dir_table_and_exit_codes(realdata, tmp_path, capsys):
    good = tmp_path / "good"
    (good / "sub").mkdir(parents=True)
    for name in (
        "cloneofsimo__lora__analog_svd_rank4.safetensors",
        "leighwoods__public-loras__lora.safetensors",
    ):
        (good / "sub" / name).symlink_to(realdata / "lora" / name)
    (good / "embedding.pt").write_bytes(b"not read")
    assert main(["inspect", str(good), "--strict"]) == 0
    out = capsys.readouterr().out
    assert "sub/cloneofsimo__lora__analog_svd_rank4.safetensors" in out and "YEW" in out
    assert "left out embedding.pt: pickle file" in out and "2 adapters, 0 unreadable, 2 with every key" in out
    _sd1_file(good / "partial.safetensors")  # two keys land nowhere
    assert main(["inspect", str(good)]) == 0
    assert main(["inspect", str(good), "--strict"]) == 1
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty")]) == 1  # nothing to do
    assert main(["inspect", str(good), "--plot", str(tmp_path / "x.png")]) == 2
    assert "--plot draws one adapter" in capsys.readouterr().err


def test_inspect_dir_rows_equal_single_file_inspect(realdata, capsys):
    path = realdata / "lora" / "KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr.safetensors"
    assert main(["inspect", str(path), "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    main(["inspect", str(realdata / "lora"), "--json"])
    row = next(r for r in json.loads(capsys.readouterr().out) if r["file"] == path.name)
    for key in ("layout", "families", "architecture", "coverage", "ranks", "alphas", "metadata"):
        assert row[key] == single[key], key
