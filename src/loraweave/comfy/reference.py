"""The ComfyUI facets of the registry's architectures (arch/record.py `ComfyFacets`), as the pack reads them:
which architecture a ComfyUI model class is, and the diffusers config of a model's reference tree from
ComfyUI's `unet_config` (the widths and depths a loaded model really has: a tiny test model, a pruned or
distilled release) over the catalog's full-size config.

Only shapes matter (the tree lives on `meta`); an architecture whose facets give no config keeps the catalog
config, and `targets.reference_tree` checks the fit against the ComfyUI model's own tensor shapes either way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..arch import registry
from ..arch.record import ComfyFacets

NO_FACETS = ComfyFacets(())


def facets(arch: str) -> ComfyFacets:
    """The ComfyUI facets of the registered architecture `arch` (NO_FACETS: none, or no such architecture)."""
    record = registry.by_name().get(arch)
    return record.comfy if record is not None and record.comfy is not None else NO_FACETS


class _ComfyArchs(Mapping):
    """ComfyUI's supported_models class name -> the architecture whose facets list it, read from the registry
    on every access (so a registered one is in it)."""

    def _entries(self) -> dict[str, str]:
        return {cls: a.name for a in registry.ARCHITECTURES if a.comfy is not None for cls in a.comfy.classes}

    def __getitem__(self, name: str) -> str:
        return self._entries()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())


COMFY_ARCHS: Mapping[str, str] = _ComfyArchs()


def reference_config(arch: str, unet_config: dict) -> dict:
    """diffusers config entries for `arch` read from ComfyUI's unet_config ({} where the catalog's stand)."""
    convert = facets(arch).config
    return convert(unet_config) if convert is not None else {}
