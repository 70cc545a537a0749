"""Issue 42's CLI defects (round 3 of a new user's trial): each test failed before its fix."""

from __future__ import annotations

import numpy as np

from loraweave.tools.heatmap import _font, _vertical_label


def _dot_runs(text: str) -> int:
    """Runs of ink columns in `text`'s column label (turned back to horizontal) that are a dot: set apart by
    blank columns, at most 2 wide and 3 tall (an underscore is wider)."""
    strip = np.asarray(_vertical_label(text, _font(10), 400).rotate(-90, expand=True))[:, :, 3]
    ink = strip > 128
    cols = ink.any(axis=0)
    runs, start = [], None
    for x, on in enumerate([*cols, False]):
        if on and start is None:
            start = x
        elif not on and start is not None:
            runs.append(ink[:, start:x])
            start = None
    return sum(1 for r in runs if r.shape[1] <= 2 and np.ptp(np.flatnonzero(r.any(axis=1))) < 3 and r.sum() >= 2)


def test_heatmap_column_labels_keep_their_dots():  # item 21
    for label in ("attn1.to_out.0", "ff.net.0.proj", "attn2.to_k"):
        assert _dot_runs(label) == label.count("."), label
