"""A model checkpoint on disk (single file, diffusers component folder, sharded folder, pipeline folder), read
lazily through memory maps, and a shadow module tree on `meta` built from its tensor names and shapes, so the
planner resolves adapter keys against the checkpoint without building (or loading) the real model."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..formats.keys import COMPONENT_NAMES
from ..io.safetensors_file import SafetensorsFile

log = logging.getLogger("loraweave")

# Single-file (ldm/ComfyUI) checkpoints hold several components under fixed prefixes.
SINGLE_FILE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.diffusion_model.", "denoiser"),
    ("cond_stage_model.transformer.", "text_encoder"),
    ("conditioner.embedders.0.transformer.", "text_encoder"),
    ("text_encoders.clip_l.transformer.", "text_encoder"),
)


@dataclass
class Component:
    """One model component: its tensors (name -> shard file) and where its module paths start."""

    name: str  # "transformer", "unet", "text_encoder", ... ("denoiser" when nothing says which)
    class_name: str | None  # diffusers/transformers class from config.json, when there is one
    prefix: str  # stripped from tensor names to get module paths ("" for folders)
    tensors: dict[str, Path] = field(default_factory=dict)  # full tensor name -> shard
    folder: Path | None = None
    index_file: Path | None = None


@dataclass
class Checkpoint:
    kind: str  # "file" | "folder" | "pipeline"
    root: Path
    components: list[Component]
    files: list[Path]  # every safetensors shard, in output order
    passthrough: dict[str, Path] = field(default_factory=dict)  # single file: tensors no component owns
    _open: dict[Path, SafetensorsFile] = field(default_factory=dict)

    def source(self, shard: Path) -> SafetensorsFile:
        if shard not in self._open:
            self._open[shard] = SafetensorsFile(shard)
        return self._open[shard]

    def close(self) -> None:
        for sf in self._open.values():
            sf.close()
        self._open.clear()


def _config_class(folder: Path) -> str | None:
    config = folder / "config.json"
    if not config.exists():
        return None
    data = json.loads(config.read_text())
    return data.get("_class_name") or (data.get("architectures") or [None])[0]


def _component_name(folder: Path, class_name: str | None) -> str:
    if (
        folder.name in COMPONENT_NAMES
    ):  # Anima's text_conditioner, LTX-2's connectors: not "transformer" by class
        return folder.name
    if class_name and class_name.startswith("UNet"):
        return "unet"
    if class_name and "TextModel" in class_name or class_name and "EncoderModel" in class_name:
        return "text_encoder"
    return "transformer" if class_name else "denoiser"


def _folder_component(folder: Path, in_pipeline: bool = False) -> Component | None:
    class_name = _config_class(folder)
    name = folder.name if in_pipeline else _component_name(folder, class_name)
    comp = Component(name, class_name, "", folder=folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        comp.index_file = indexes[0]
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        comp.tensors = {name: folder / shard for name, shard in weight_map.items()}
    else:
        for shard in sorted(folder.glob("*.safetensors")):
            for name in SafetensorsFile(shard).keys():
                comp.tensors[name] = shard
    refuse_adapter(folder, comp.tensors)
    return comp if comp.tensors else None


def refuse_adapter(where: Path, names: Iterable[str]) -> None:
    """CheckpointError when every tensor name is an adapter's (LoRA factors, alphas, LyCORIS weights): an
    adapter given where a model is read would resolve no key ("no such module" for each) and exit 0."""
    from ..formats.keys import ParsedKey, parse_key

    factor = None
    for name in names:
        parsed = parse_key(name)
        if not isinstance(parsed, ParsedKey):
            return  # a model weight: stop at the first (cheap on a real checkpoint)
        if factor is None and parsed.role not in ("alpha", "scale"):
            factor = name
    if factor is not None:
        raise CheckpointError(
            f"{where}: an adapter file (tensors such as {factor!r}), not a model checkpoint; give the "
            "model's checkpoint here (the adapter goes in its own argument)"
        )


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Describe a checkpoint; nothing but headers is read."""
    root = Path(path)
    if root.is_file():
        return _open_file(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such file or folder")
    if (root / "model_index.json").exists():
        return _open_pipeline(root)
    comp = _folder_component(root)
    if comp is None:
        raise CheckpointError(f"{root}: folder holds no .safetensors weights (and no model_index.json)")
    return Checkpoint("folder", root, [comp], sorted(set(comp.tensors.values())))


def _open_file(root: Path) -> Checkpoint:
    """A single .safetensors file: components by key prefix, or one bare module state dict."""
    if root.suffix != ".safetensors":
        raise CheckpointError(f"{root}: only .safetensors checkpoints are read")
    names = SafetensorsFile(root).keys()
    refuse_adapter(root, names)
    comps: dict[str, Component] = {}
    passthrough: dict[str, Path] = {}
    class_name = _config_class(root.parent) if root.parent.joinpath("config.json").exists() else None
    for name in names:
        hit = next(((p, c) for p, c in SINGLE_FILE_PREFIXES if name.startswith(p)), None)
        if hit is None:
            passthrough[name] = root
            continue
        comps.setdefault(hit[1], Component(hit[1], None, hit[0])).tensors[name] = root
    if not comps:  # a bare module state dict (diffusers single file, or BFL/ComfyUI weights)
        comp = Component(
            _component_name(root.parent, class_name) if class_name else "denoiser", class_name, ""
        )
        comp.tensors = dict(passthrough)
        return Checkpoint("file", root, [comp], [root])
    return Checkpoint("file", root, list(comps.values()), [root], passthrough)


def _open_pipeline(root: Path) -> Checkpoint:
    """A diffusers pipeline folder: one component per subfolder holding weights."""
    comps_list = [
        c for sub in sorted(p for p in root.iterdir() if p.is_dir()) if (c := _folder_component(sub, True))
    ]
    if not comps_list:
        raise CheckpointError(f"{root}: pipeline folder holds no .safetensors weights")
    files = sorted({f for c in comps_list for f in c.tensors.values()})
    return Checkpoint("pipeline", root, comps_list, files)


class _Node(torch.nn.Module):
    """A container whose numbered children iterate like a ModuleList (UNet name mapping walks them)."""

    def __iter__(self):
        return iter(
            v for _, v in sorted(self._modules.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1)
        )

    def __len__(self) -> int:
        return len(self._modules)


class _Weighted(torch.nn.Module):
    """A leaf with a weight of any rank (conv, norm, embedding) on meta."""


def shadow_tree(comp: Component, checkpoint: Checkpoint) -> torch.nn.Module:
    """Module tree on `meta` with one module per `<path>.weight` tensor; the root takes the config's class
    name so architecture alias tables (original <-> diffusers names) apply as they do to the real model."""
    root_cls = type(comp.class_name or "CheckpointModel", (_Node,), {"__module__": __name__})
    root = root_cls()
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, shard in comp.tensors.items():
        sf = checkpoint.source(shard)
        shapes[name[len(comp.prefix) :]] = (sf.dtype(name), sf.shape(name))
    for name, (dtype, shape) in shapes.items():
        if (
            not name.endswith(".weight")
            or not dtype.is_floating_point
            and dtype not in (torch.int8, torch.uint8)
        ):
            continue
        path = name[: -len(".weight")]
        parent = root
        parts = path.split(".")
        for part in parts[:-1]:
            child = parent._modules.get(part)
            if child is None:
                child = _Node()
                parent.add_module(part, child)
            parent = child
        if parts[-1] in parent._modules:  # a module with children and its own weight: keep the children
            leaf = parent._modules[parts[-1]]
        elif len(shape) == 2:
            leaf = torch.nn.Linear(
                shape[1], shape[0], bias=f"{path}.bias" in shapes, device="meta", dtype=dtype
            )
            parent.add_module(parts[-1], leaf)
            continue
        else:
            leaf = _Weighted()
            parent.add_module(parts[-1], leaf)
        leaf.weight = torch.nn.Parameter(torch.empty(shape, device="meta", dtype=dtype), requires_grad=False)
        if f"{path}.bias" in shapes:
            b_dtype, b_shape = shapes[f"{path}.bias"]
            leaf.bias = torch.nn.Parameter(
                torch.empty(b_shape, device="meta", dtype=b_dtype), requires_grad=False
            )
    return root


def shadow_components(checkpoint: Checkpoint) -> dict[str, torch.nn.Module]:
    return resolution_components(checkpoint)[0]


def resolution_components(checkpoint: Checkpoint) -> tuple[dict[str, torch.nn.Module], dict[str, dict]]:
    """({component: module tree to resolve adapter keys against}, {component: spans to original tensor rows}).

    Folders use their own names (shadow tree). A single file in original names (BFL Flux, ldm/sgm UNet)
    resolves against the diffusers tree of its architecture, so both spellings of adapter keys land, and
    merged rows are written back through the spans."""
    from .remap import reference_for

    trees: dict[str, torch.nn.Module] = {}
    spans: dict[str, dict] = {}
    for comp in checkpoint.components:
        found = None
        if checkpoint.kind == "file" and comp.name in ("denoiser", "transformer", "unet"):
            shapes = {n[len(comp.prefix) :]: checkpoint.source(s).shape(n) for n, s in comp.tensors.items()}
            found = reference_for(shapes, checkpoint.root.parent)
        if found is not None:
            trees[comp.name], spans[comp.name] = found
        else:
            trees[comp.name] = shadow_tree(comp, checkpoint)
    return trees, spans
