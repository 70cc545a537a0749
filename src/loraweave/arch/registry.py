"""The architectures, once: adding one is its module (arch/<x>.py, its `Architecture` record) plus a line
here.

The order is detection's precedence: the most specific signatures first (arch/detect.py tries them in this
order; shared names fold from the most general record up, so every owner comes before the names it owns).
Records without a signature (catalog-only variants, table-only architectures) may sit anywhere."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ArgumentError
from .ace_step import ACE_STEP_ARCH
from .anima import ANIMA_ARCH
from .ernie_image import ERNIE_IMAGE
from .flux import CHROMA_ARCH, FLUX_ARCH, FLUX_SCHNELL
from .flux2 import FLUX2_ARCH, FLUX2_KLEIN_4B, FLUX2_KLEIN_9B
from .flux3 import FLUX3_ARCH
from .hidream_o1 import HIDREAM_O1
from .hunyuan_video import HUNYUAN_VIDEO_ARCH
from .hunyuan_video15 import HUNYUAN_IMAGE_21, HUNYUAN_VIDEO_15
from .ideogram4 import IDEOGRAM4_ARCH
from .kandinsky import KANDINSKY5, KANDINSKY6
from .krea2 import KREA2_ARCH
from .ltx import LTX2_ARCH, LTX23_ARCH, LTX_VIDEO
from .lumina2 import LUMINA2_ARCH
from .minimax_h3 import MINIMAX_H3_ARCH
from .pixart import PIXART
from .qwenimage21 import QWEN_IMAGE, QWEN_IMAGE_21
from .record import Architecture
from .sana import SANA_ARCH
from .sd3 import SD3_ARCH
from .shared import CROSS_DIT, MMDIT
from .spec import ArchTable
from .unet import SD1, SD2, SDXL, SDXL_REFINER, UNET
from .wan import WAN_ARCH
from .wan_animate import WAN_ANIMATE_2_ARCH, WAN_ANIMATE_ARCH
from .zimage import ZIMAGE_ARCH

ARCHITECTURES: list[Architecture] = [
    FLUX2_ARCH,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    SD3_ARCH,
    LTX23_ARCH,
    LTX2_ARCH,
    HUNYUAN_VIDEO_ARCH,
    HUNYUAN_IMAGE_21,
    HUNYUAN_VIDEO_15,
    MINIMAX_H3_ARCH,
    CHROMA_ARCH,
    FLUX_ARCH,
    FLUX_SCHNELL,
    QWEN_IMAGE_21,
    QWEN_IMAGE,
    KANDINSKY6,
    KANDINSKY5,
    ERNIE_IMAGE,
    SANA_ARCH,
    CROSS_DIT,
    MMDIT,
    IDEOGRAM4_ARCH,
    LUMINA2_ARCH,
    ZIMAGE_ARCH,
    ANIMA_ARCH,
    WAN_ANIMATE_ARCH,
    WAN_ANIMATE_2_ARCH,
    WAN_ARCH,
    UNET,
    SD1,
    SD2,
    SDXL,
    SDXL_REFINER,
    LTX_VIDEO,
    PIXART,
    KREA2_ARCH,
    FLUX3_ARCH,
    ACE_STEP_ARCH,
    HIDREAM_O1,
]


def by_name() -> dict[str, Architecture]:
    return {a.name: a for a in ARCHITECTURES}


def of_class(cls_name: str) -> list[Architecture]:
    """The records whose model class is `cls_name` (their own table's or their skeleton's), registry
    order."""
    return [
        a
        for a in ARCHITECTURES
        if (a.tables and cls_name in a.tables[0].classes) or (a.skeleton and a.skeleton.cls == cls_name)
    ]


# arch_tables()'s cache: (the list it was read from, its generation, the tables); registered() moves the
# generation, and a list replaced whole (tests' monkeypatch) is another list.
_generation = 0
_cached: tuple[list[Architecture], int, tuple[ArchTable, ...]] | None = None


def arch_tables() -> tuple[ArchTable, ...]:
    """Every alias table of the registered architectures: each one's own first (in registry order), then the
    extra ones. Read live from `ARCHITECTURES`, cached until registered() changes it or the list is replaced;
    arch.aliases asks on every lookup it builds, so this stays one identity check when nothing changed."""
    global _cached
    if _cached is not None and _cached[0] is ARCHITECTURES and _cached[1] == _generation:
        return _cached[2]
    tables = tuple(a.tables[0] for a in ARCHITECTURES if a.tables) + tuple(
        t for a in ARCHITECTURES for t in a.tables[1:]
    )
    _cached = (ARCHITECTURES, _generation, tables)
    return tables


def _moved() -> None:
    global _generation
    _generation += 1


@contextmanager
def registered(arch: Architecture, before: str | None = None) -> Iterator[Architecture]:
    """`arch` in the registry for the duration (before the record named `before`, else last): for tests and
    plug-ins that add an architecture without a line here. Every reader takes it up while it is in, its alias
    tables included: detection, the catalog and the block maps read the registry on every call, and
    arch.aliases reads the tables through `arch_tables()`, whose cache this invalidates on entry and exit.
    Alias tables built before entry (an `AliasTable`, a ComfyUI reference tree) keep the tables they were
    built with."""
    names = [a.name for a in ARCHITECTURES]
    if arch.name in names:
        raise ArgumentError(f"architecture {arch.name!r} is registered already")
    if before is not None and before not in names:
        raise ArgumentError(f"registered(before={before!r}): no such architecture; have {sorted(names)}")
    at = names.index(before) if before is not None else len(ARCHITECTURES)
    ARCHITECTURES.insert(at, arch)
    _moved()
    try:
        yield arch
    finally:
        ARCHITECTURES.remove(arch)
        _moved()
