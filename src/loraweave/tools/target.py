"""Which model an adapter is checked against, as `inspect` chooses it: the architecture the file names, a UNet
told apart by fit, a Flux-family variant by block counts; and shape-only probes that plan without reading
data."""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

from ..arch.detect import UNET, detect_architecture, metadata_evidence
from ..arch.variants import BFL_NAMED, variant_fit
from ..formats.adapter import Adapter

if TYPE_CHECKING:
    import torch


class ShapeOnlySource:
    """Tensors as `meta` (shape and dtype, no data) except scalars (alphas): planning then checks every key's
    target and shapes without reading or validating the factor values (--check-values does that)."""

    def __init__(self, source) -> None:
        self._source = source

    def keys(self) -> list[str]:
        return self._source.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._source.shape(key))

    def dtype(self, key: str) -> torch.dtype:
        return self._source.dtype(key) if hasattr(self._source, "dtype") else self._source.get(key).dtype

    def get(self, key: str) -> torch.Tensor:
        shape = self.shape(key)
        if math.prod(shape) <= 1:
            return self._source.get(key)
        import torch

        return torch.empty(shape, dtype=self.dtype(key), device="meta")


def shape_only(adapter: Adapter) -> Adapter:
    probe = copy.copy(adapter)
    probe.source = ShapeOnlySource(adapter.source)
    return probe


def model_target(arch: str | None, model: str | None, detected: str, text_encoders: bool):
    """(components, description) to resolve against, or (None, why not)."""
    if model is not None:
        from .checkpoint import open_checkpoint, shadow_components

        ckpt = open_checkpoint(model)
        try:
            return shadow_components(ckpt), f"checkpoint {model} ({ckpt.kind}, shadow tree on meta)"
        finally:
            ckpt.close()
    from ..arch.catalog import canonical
    from .skeleton import skeleton

    if arch is None and detected == UNET:  # the shape fit found no UNet that takes the file
        return None, "no UNet (sd1, sd2, sdxl) takes its shapes; pass --arch or --model"
    name = arch or detected
    try:
        name = canonical(name)
    except ValueError as exc:
        if arch is not None:
            raise
        return None, f"no full-size model for architecture {detected!r} ({exc}); pass --arch or --model"
    return skeleton(name, text_encoders=text_encoders), f"architecture {name} (full size, meta device)"


UNET_CANDIDATES = ("sd1", "sd2", "sdxl")


def adapter_target(adapter: Adapter, arch: str | None, model: str | None, text_encoders: bool = True):
    """(components or None, what they are or why none, detected architecture) as `inspect` chooses them: the
    architecture the file names, a UNet file told apart by fit, unless `arch` or `model` says otherwise."""
    detection = detect_architecture(adapter)
    if detection.architecture == UNET and arch is None and model is None:
        detection = _unet_by_fit(adapter, detection, text_encoders)
    detection = by_variant(detection, variant_fit(adapter), arch, model)
    components, against = model_target(arch, model, detection.architecture, text_encoders)
    return components, against, detection.architecture


def by_variant(detection, fit: dict, arch: str | None, model: str | None):
    """A Flux-family file whose block counts and widths name one variant with its own skeleton (Flux.2 klein,
    or Flux.2 written in BFL names that Flux.1 shares) is checked against that skeleton."""
    catalog = fit.get("catalog")
    if (
        arch is None
        and model is None
        and catalog
        and detection.architecture in BFL_NAMED
        and catalog != detection.architecture
    ):
        detection.evidence.append(f"block counts and widths name {fit['likely']} -> {catalog}")
        detection.architecture = catalog
    return detection


def _unet_by_fit(adapter: Adapter, detection, text_encoders: bool):
    """Names alone say "a UNet"; shapes say which: the candidate on which the most keys land wins."""
    return unet_fit(adapter, detection, text_encoders)[0]


def unet_fit(adapter: Adapter, detection, text_encoders: bool):
    """(`_unet_by_fit`'s detection, the winner's shape-only plan report, which is the coverage plan too)."""
    from ..api import plan
    from .skeleton import alias_tables, skeleton

    probe = shape_only(adapter)
    reports = {}
    for name in UNET_CANDIDATES:
        skel = skeleton(name, text_encoders)
        reports[name] = plan(skel, probe, tables=alias_tables(skel))
    fits = {name: r.keys_applied for name, r in reports.items()}
    best = max(fits, key=lambda n: fits[n])  # ties keep the earlier (older, more common) UNet
    landed = ", ".join(f"{n}: {k}/{adapter.keys_total} keys land" for n, k in fits.items())
    if fits[best] == 0:  # nothing fits: no UNet is named (model_target then resolves against none)
        detection.evidence.append(f"shapes fit {landed} -> none of them")
        return detection, None
    detection.architecture = best
    detection.evidence.append(f"shapes fit {landed} -> {best}")
    said = metadata_evidence(detection.metadata, best) if detection.metadata else ""
    # what the metadata says, judged against the UNet the shapes chose, where detection put its line
    detection.evidence[:] = [said if e.startswith("metadata ") else e for e in detection.evidence]
    return detection, reports[best]
