"""Issue 30, a new user's second run-through: what `inspect` says about real files (item 11) and draws
(12)."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REALDATA
from PIL import Image
from safetensors import safe_open

from loraweave.cli import main
from loraweave.tools.heatmap import INK, colour
from loraweave.tools.inspect import format_table, inspect_adapter

LORA = REALDATA / "lora"
FLUX_AI_TOOLKIT = LORA / "leighwoods__public-loras__lora.safetensors"
SD1_LOKR = ("KohakuBlueleaf__LyCORIS__smart_falcon_4_lokr", "KohakuBlueleaf__LyCORIS__smart_falcon_8_lokr")


def test_sd1_lokr_files_show_no_flux_variant_list(realdata):
    """An SD1 UNet's `transformer_blocks.0` is no Flux double block: no Flux/Hunyuan release is offered."""
    for name in SD1_LOKR:
        info = inspect_adapter(LORA / f"{name}.safetensors")
        assert info["architecture"]["name"] == "sd1"
        assert info["variant"]["fits"] == [] and info["variant"]["likely"] is None
        table = format_table(info)
        assert "variant" not in table and "double blocks" not in table, table


def test_flux_ai_toolkit_file_that_lands_names_flux1(realdata):
    """The file trains only single blocks' `proj_out` (input hidden * (1 + mlp_ratio), 5x the hidden width),
    up to block 20: the Flux.1-dev config (38 single blocks, 24 heads x 128) takes it, and every key lands."""
    config = json.loads((REALDATA / "configs" / "flux1-dev__transformer_config.json").read_text())
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    with safe_open(FLUX_AI_TOOLKIT, "pt") as f:
        widths = {f.get_slice(k).get_shape()[1] for k in f.keys() if k.endswith("lora_A.weight")}
        top = max(int(k.split(".")[2]) for k in f.keys())
    assert widths == {hidden * 5} and top < config["num_single_layers"]

    info = inspect_adapter(FLUX_AI_TOOLKIT)
    assert info["coverage"]["keys_applied"] == info["coverage"]["keys_total"] == 8
    assert info["variant"]["likely"] == "flux1 (dev, schnell, Fill, Kontext)"
    table = format_table(info)
    assert "no known variant" not in table
    assert (
        "flux1 (dev, schnell, Fill, Kontext) (file: single blocks 7-20 (4 of them), width 15360; every key "
        "lands" in table  # the blocks it names, not "21 single blocks" (issue 42 item 9)
    )
    # without the coverage check nothing vouches for the width: no release is named, and none of Flux.2's
    assert inspect_adapter(FLUX_AI_TOOLKIT, coverage=False)["variant"]["fits"] == []


SD1_DIFFUSERS = LORA / "catundchat__stable-diffusion-v1.5-lora__pytorch_lora_weights.safetensors"


def _ink_gaps(img: Image.Image, top: int, bottom: int) -> list[int]:
    """Widths of the ink-free column runs between the first and last inked column of rows [top, bottom)."""
    grey = img.convert("L")
    ink = [any(grey.getpixel((x, y)) < 140 for y in range(top, bottom)) for x in range(img.width)]
    first, last = ink.index(True), len(ink) - 1 - ink[::-1].index(True)
    gaps, run = [], 0
    for inked in ink[first : last + 1]:
        if inked and run:
            gaps.append(run)
        run = 0 if inked else run + 1
    return gaps


def test_plot_subtitle_spacing_and_colour_bar(realdata, tmp_path):
    out = tmp_path / "plot.png"
    assert main(["inspect", str(SD1_DIFFUSERS), "--plot", str(out)]) == 0
    img = Image.open(out)
    data = json.loads(img.text["loraweave.plot"])
    words = len("sd1: ||dW||_F at strength 1 per block x module kind; grey: not touched".split())
    # the subtitle's row band (title at y=4, subtitle 15 px below): a gap of 4+ px between every two words
    assert sum(gap >= 4 for gap in _ink_gaps(img, 19, 33)) >= words - 1

    geo = data["geometry"]
    bar, vmax = geo["bar"], geo["vmax"]
    ticks = bar["ticks"]
    step = ticks[1]
    mantissa = step / 10 ** math.floor(math.log10(step))
    assert 3 <= len(ticks) <= 6 and ticks[0] == 0 and min(abs(mantissa - m) for m in (1, 2, 2.5, 5)) < 1e-9
    assert (
        all(t == pytest.approx(i * step) for i, t in enumerate(ticks))
        and ticks[-1] <= vmax < ticks[-1] + step
    )
    assert bar["label"].startswith("||dW||_F") and f"{vmax:.3g}" in bar["label"]
    rgb = img.convert("RGB")
    for t in ticks:  # the ramp's colour at each tick's row, and the tick mark beside it
        k = round((1 - t / vmax) * (bar["h"] - 1))
        assert rgb.getpixel((bar["x"] + 6, bar["y"] + k)) == colour(1 - k / (bar["h"] - 1))
        assert rgb.getpixel((bar["x"] + 14, bar["y"] + k)) == INK
    label_x = bar["x"] + 18 + 40  # past the tick numbers: the rotated label has ink
    assert any(
        rgb.getpixel((x, y))[0] < 140
        for x in range(label_x - 20, min(img.width, label_x + 20))
        for y in range(bar["y"], bar["y"] + 120)
    )


@pytest.mark.parametrize(
    "target, extra, message",
    [
        ("plot.jpg", [], "name a .png file"),
        ("plot", [], "name a .png file"),
        ("folder", [], "is a folder"),
        ("plot.png", ["--no-coverage"], "drop --no-coverage"),
    ],
)
def test_plot_targets_refused_before_any_work(
    realdata, tmp_path, monkeypatch, capsys, target, extra, message
):
    """A .jpg would drop the numbers the PNG text chunk stores; a folder failed after 2 s with PIL's message;
    --no-coverage still resolved every key for the plot. All refused at once (exit 2), nothing written."""
    import loraweave.tools.inspect as inspect_module
    import loraweave.tools.plot as plot_module

    def resolved(*args, **kwargs):
        raise AssertionError("resolved keys before refusing")

    monkeypatch.setattr(inspect_module, "inspect_adapter", resolved)
    monkeypatch.setattr(plot_module, "block_grid", resolved)
    (tmp_path / "folder").mkdir()
    before = sorted(tmp_path.iterdir())
    assert main(["inspect", str(SD1_DIFFUSERS), "--plot", str(tmp_path / target), *extra]) == 2
    assert message in capsys.readouterr().err
    assert sorted(tmp_path.iterdir()) == before
