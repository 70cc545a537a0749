"""One progress-bar helper for every long loop (extract, resize, convert, bake, inspect DIR, large applies).

Callers pass `enabled`; the CLI turns it on only on a terminal and never under --json (`cli_progress`)."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

PROGRESS_LAYERS = 200  # apply shows a bar (on a terminal) above this many layers: ~2 s of merging on a CPU


def on_terminal() -> bool:
    return sys.stderr.isatty()


def bar(
    iterable: Iterable | None = None,
    total: int | None = None,
    desc: str = "loraweave",
    unit: str = "it",
    enabled: bool | None = False,
    **kw,
):
    """A tqdm bar on stderr, disabled unless `enabled` (None: when stderr is a terminal)."""
    show = on_terminal() if enabled is None else enabled
    return tqdm(
        iterable, total=total, desc=desc, unit=unit, disable=not show, leave=False, file=sys.stderr, **kw
    )
