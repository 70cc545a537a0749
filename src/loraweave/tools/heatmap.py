"""Draw a BlockGrid as a PNG heatmap with Pillow alone (no plotting library): rows = blocks, columns = module
kinds, colour = value / max on a viridis-like ramp, grey = not touched. The grid's numbers and the cell geometry
are stored in a `loraweave.plot` text chunk, so the picture can be read back exactly."""

from __future__ import annotations

import json
from pathlib import Path

from .plot import BlockGrid

CELL_W, CELL_H, PAD = 22, 14, 8
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
    return tuple(round(a + (b - a) * f) for a, b in zip(RAMP[i], RAMP[i + 1], strict=True))


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def _text_size(draw, text: str, font) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def _vertical_label(text: str, font, height: int):
    """`text` rotated 90° (reads bottom to top), on a transparent strip `height` tall."""
    from PIL import Image, ImageDraw

    probe = ImageDraw.Draw(Image.new("L", (1, 1)))
    w, h = _text_size(probe, text, font)
    strip = Image.new("RGBA", (max(w, 1) + 2, h + 6), (0, 0, 0, 0))
    ImageDraw.Draw(strip).text((1, 0), text, fill=INK, font=font)
    return strip.rotate(90, expand=True).crop((0, 0, h + 6, min(height, w + 2)))


def render(grid: BlockGrid, out: str | Path) -> dict:
    """Write the heatmap PNG; returns the geometry stored beside the numbers (x0, y0, cell_w, cell_h)."""
    from PIL import Image, ImageDraw
    from PIL.PngImagePlugin import PngInfo

    font, small = _font(11), _font(10)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    label_w = max([_text_size(probe, r, font)[0] for r in grid.rows] + [40]) + PAD
    head_h = max([_text_size(probe, c, small)[0] for c in grid.columns] + [40]) + PAD
    title_h = 36
    x0, y0 = PAD + label_w, title_h + head_h
    width = x0 + CELL_W * max(len(grid.columns), 1) + 90
    height = max(y0 + CELL_H * max(len(grid.rows), 1) + PAD, y0 + 160)
    what = "||dW||_F at strength 1" if grid.metric == "norm" else "share of sum ||dW||^2"
    titles = [
        (Path(grid.file).name, font),
        (f"{grid.architecture}: {what} per block x module kind; grey: not touched", small),
    ]
    width = max([width] + [_text_size(probe, t, f)[0] + 2 * PAD for t, f in titles])
    img = Image.new("RGB", (width, height), BACKGROUND)
    draw = ImageDraw.Draw(img)
    vmax = max((v for row in grid.values for v in row if v is not None), default=0.0)
    for k, (text, f) in enumerate(titles):
        draw.text((PAD, 4 + 15 * k), text, fill=INK, font=f)
    for j, name in enumerate(grid.columns):
        label = _vertical_label(name, small, head_h - 4)
        img.paste(label, (x0 + CELL_W * j + (CELL_W - label.width) // 2, y0 - 4 - label.height), label)
    for i, name in enumerate(grid.rows):
        y = y0 + CELL_H * i
        draw.text((PAD, y + 1), name, fill=INK, font=font)
        for j, v in enumerate(grid.values[i]):
            fill = EMPTY if v is None else colour(v / vmax if vmax > 0 else 0.0)
            draw.rectangle((x0 + CELL_W * j, y, x0 + CELL_W * (j + 1) - 2, y + CELL_H - 2), fill=fill)
    _colour_bar(draw, x0 + CELL_W * max(len(grid.columns), 1) + 14, y0, vmax, small)
    geometry = {"x0": x0, "y0": y0, "cell_w": CELL_W, "cell_h": CELL_H, "vmax": vmax, "empty": list(EMPTY)}
    info = PngInfo()
    info.add_text("loraweave.plot", json.dumps({**grid.to_dict(), "geometry": geometry}))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    img.save(out, pnginfo=info)
    return geometry


def _colour_bar(draw, x: int, y: int, vmax: float, font, h: int = 140) -> None:
    for k in range(h):
        draw.line((x, y + k, x + 12, y + k), fill=colour(1 - k / (h - 1)))
    draw.text((x + 16, y - 4), f"{vmax:.3g}", fill=INK, font=font)
    draw.text((x + 16, y + h - 8), "0", fill=INK, font=font)
