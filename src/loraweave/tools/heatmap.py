"""Draw a BlockGrid as a PNG heatmap with Pillow alone (no plotting library): rows = blocks, columns = module
kinds, colour = value / max on a viridis-like ramp, grey = not touched. The grid's numbers and the cell
geometry are stored in a `loraweave.plot` text chunk, so the picture can be read back exactly."""

from __future__ import annotations

import json
from pathlib import Path

from .plot import BlockGrid

CELL_W, CELL_H, PAD = 22, 14, 8
BAR_H = 140
EMPTY = (232, 232, 232)
BACKGROUND = (255, 255, 255)
INK = (20, 20, 20)
# Anchor colours of matplotlib's viridis at 0, .25, .5, .75, 1 (perceptually even, readable in greyscale).
RAMP = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))


def colour(t: float) -> tuple[int, int, int]:
    """Ramp colour of t in [0, 1] (clamped), linear between anchors."""
    t = min(max(t, 0.0), 1.0) * (len(RAMP) - 1)
    i = min(int(t), len(RAMP) - 2)
    f = t - i
    r, g, b = (round(lo + (hi - lo) * f) for lo, hi in zip(RAMP[i], RAMP[i + 1], strict=True))
    return r, g, b


def default_font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _text_size(draw, text: str, font) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def _word_gap(font) -> int:
    """Pixels between words: Pillow's default font draws a space 2 px wide at 10 px, which runs words
    together."""
    return max(4, round(getattr(font, "size", 10) * 0.4))


def _words_width(draw, text: str, font) -> int:
    words = text.split(" ")
    return sum(_text_size(draw, w, font)[0] for w in words) + _word_gap(font) * (len(words) - 1)


def _draw_words(draw, xy: tuple[int, int], text: str, font) -> None:
    """`text` drawn word by word with `_word_gap` between words."""
    x, y = xy
    for word in text.split(" "):
        draw.text((x, y), word, fill=INK, font=font)
        x += _text_size(draw, word, font)[0] + _word_gap(font)


def nice_ticks(vmax: float, most: int = 6) -> list[float]:
    """0 and multiples of a 1-2-2.5-5 x 10^k step up to `vmax`, at least 3 and at most `most` of them."""
    import math

    if not vmax > 0 or not math.isfinite(vmax):
        return [0.0]
    for k in range(math.floor(math.log10(vmax)) - 2, math.floor(math.log10(vmax)) + 2):
        for mantissa in (1, 2, 2.5, 5):
            step = mantissa * 10.0**k
            count = math.floor(vmax / step * (1 + 1e-9)) + 1
            if 3 <= count <= most:
                return [round(i * step, 12) for i in range(count)]
    return [0.0, vmax]


DOT, DOT_GAP = 2, 2  # a module path's dots: a square this wide, blank columns this wide either side


def _dotted_width(draw, text: str, font) -> int:
    parts = text.split(".")
    return sum(_text_size(draw, p, font)[0] for p in parts) + (DOT + 2 * DOT_GAP) * (len(parts) - 1)


def _draw_dotted(draw, xy: tuple[int, int], text: str, font) -> None:
    """`text` with each dot drawn as a DOT-wide square between blank gaps: the font's 1-pixel dot touches
    its neighbours at 10 px, so `to_out.0` read as `to_out0`."""
    x, y = xy
    baseline = y + draw.textbbox((0, 0), "x", font=font)[3]
    for k, part in enumerate(text.split(".")):
        if k:
            x += DOT_GAP
            draw.rectangle((x, baseline - DOT, x + DOT - 1, baseline - 1), fill=INK)
            x += DOT + DOT_GAP
        left = draw.textbbox((0, 0), part, font=font)[0] if part else 0
        draw.text((x - left, y), part, fill=INK, font=font)
        x += _text_size(draw, part, font)[0]


def vertical_label(text: str, font, height: int):
    """`text` rotated 90° (reads bottom to top), on a transparent strip `height` tall."""
    from PIL import Image, ImageDraw

    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    w, h = _dotted_width(probe, text, font), _text_size(probe, text, font)[1]
    strip = Image.new("RGBA", (max(w, 1) + 2, h + 6), (0, 0, 0, 0))
    _draw_dotted(ImageDraw.Draw(strip), (1, 0), text, font)
    return strip.rotate(90, expand=True).crop((0, 0, h + 6, min(height, w + 2)))


def check_plot_target(out: str | Path) -> Path:
    """Refuse, before any work, a target that is a folder or not a .png: the numbers live in a PNG text chunk,
    which JPEG and most other formats cannot hold (PIL would drop them silently)."""
    from ..errors import ArgumentError

    path = Path(out)
    if path.is_dir():
        raise ArgumentError(f"--plot {out}: is a folder; name a .png file to write")
    if path.suffix.lower() != ".png":
        raise ArgumentError(
            f"--plot {out}: the heatmap is written as PNG, whose text chunk stores the numbers it shows "
            f"({path.suffix or 'no extension'} cannot hold them); name a .png file"
        )
    return path


def render(grid: BlockGrid, out: str | Path) -> dict:
    """Write the heatmap PNG; returns the geometry stored beside the numbers (x0, y0, cell_w, cell_h, bar)."""
    check_plot_target(out)
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    font, small = default_font(11), default_font(10)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_w = max([_text_size(probe, r, font)[0] for r in grid.rows] + [40]) + PAD
    head_h = max([_dotted_width(probe, c, small) for c in grid.columns] + [40]) + PAD
    title_h = 36
    x0, y0 = PAD + label_w, title_h + head_h
    vmax = max((v for row in grid.values for v in row if v is not None), default=0.0)
    ticks = nice_ticks(vmax)
    bar_label = ("||dW||_F" if grid.metric == "norm" else "share of sum ||dW||^2") + f" (max {vmax:.3g})"
    tick_w = max(_text_size(probe, f"{t:g}", small)[0] for t in ticks)
    width = x0 + CELL_W * max(len(grid.columns), 1) + 14 + 18 + tick_w + 6 + 16 + PAD
    height = max(
        y0 + CELL_H * max(len(grid.rows), 1) + PAD,
        y0 + BAR_H + 2 * PAD,
        y0 + _words_width(probe, bar_label, small) + PAD,
    )
    what = "||dW||_F at strength 1" if grid.metric == "norm" else "share of sum ||dW||^2"
    titles = [
        (Path(grid.file).name, font),
        (f"{grid.architecture}: {what} per block x module kind; grey: not touched", small),
    ]
    width = max([width] + [_words_width(probe, t, f) + 2 * PAD for t, f in titles])
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    for k, (text, f) in enumerate(titles):
        _draw_words(draw, (PAD, 4 + 15 * k), text, f)
    for j, name in enumerate(grid.columns):
        label = vertical_label(name, small, head_h - 4)
        img.paste(label, (x0 + CELL_W * j + (CELL_W - label.width) // 2, y0 - 4 - label.height), label)
    for i, name in enumerate(grid.rows):
        y = y0 + CELL_H * i
        draw.text((PAD, y + 1), name, fill=INK, font=font)
        for j, v in enumerate(grid.values[i]):
            fill = EMPTY if v is None else colour(v / vmax if vmax > 0 else 0.0)
            draw.rectangle((x0 + CELL_W * j, y, x0 + CELL_W * (j + 1) - 2, y + CELL_H - 2), fill=fill)
    bar = {
        "x": x0 + CELL_W * max(len(grid.columns), 1) + 14,
        "y": y0,
        "h": BAR_H,
        "ticks": ticks,
        "label": bar_label,
    }
    _colour_bar(img, draw, bar, vmax, small, tick_w)
    geometry = {
        "x0": x0,
        "y0": y0,
        "cell_w": CELL_W,
        "cell_h": CELL_H,
        "vmax": vmax,
        "empty": list(EMPTY),
        "bar": bar,
    }
    info = PngInfo()
    info.add_text("loraweave.plot", json.dumps({**grid.to_dict(), "geometry": geometry}))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    img.save(out, pnginfo=info)
    return geometry


def tick_y(bar: dict, value: float, vmax: float) -> int:
    """The bar's pixel row of `value` (its top row is vmax, its bottom row 0)."""
    return bar["y"] + round((1 - value / vmax) * (bar["h"] - 1)) if vmax > 0 else bar["y"] + bar["h"] - 1


def _colour_bar(img, draw, bar: dict, vmax: float, font, tick_w: int) -> None:
    """The ramp (top: vmax), a tick mark and number at each nice value, and the bar's label read upwards."""
    x, y, h = bar["x"], bar["y"], bar["h"]
    for k in range(h):
        draw.line((x, y + k, x + 12, y + k), fill=colour(1 - k / (h - 1)))
    for t in bar["ticks"]:
        ty = tick_y(bar, t, vmax)
        draw.line((x + 13, ty, x + 16, ty), fill=INK)
        draw.text((x + 18, ty - 6), f"{t:g}", fill=INK, font=font)
    label = _vertical_words(bar["label"], font)
    img.paste(label, (x + 18 + tick_w + 6, y), label)


def _vertical_words(text: str, font):
    """`text` (word gaps as `_draw_words`) rotated 90°, reading bottom to top, on a transparent strip."""
    from PIL import Image, ImageDraw

    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    strip = Image.new("RGBA", (_words_width(probe, text, font) + 2, 16), (0, 0, 0, 0))
    _draw_words(ImageDraw.Draw(strip), (1, 1), text, font)
    return strip.rotate(90, expand=True)
