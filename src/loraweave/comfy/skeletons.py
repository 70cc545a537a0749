"""Reference trees from descriptions shipped with the package: a queue on a full-width model builds the
diffusers tree its adapter keys resolve on without importing diffusers' model classes (a one-off of seconds
per ComfyUI process: diffusers' model modules pull in peft, accelerate, bitsandbytes, torchao and scipy where
installed).

Each `skeletons/<name>.json` (the name an architecture's ComfyUI facets give, arch/record.py
`ComfyFacets.skeleton`; written by scripts/comfy_skeletons.py from diffusers, checked against it by
tests/test_comfy_skeletons.py) holds the class name, its full diffusers config (defaults included) and the
module tree: per module its class name, own parameter and persistent buffer shapes and dtypes, and children in
`named_modules` order; numbered children with identical subtrees (a block chain) are stored once with their
count. A ComfyUI model whose config differs from the stored one only in the facets' depth keys
(`ComfyFacets.depths`) gets the chain cut or repeated to that depth, and in their width keys
(`ComfyFacets.widths`: Flux Fill's 384 input channels) that layer's axis resized; any other difference (a tiny
or re-widthed model) is not served here: the caller builds that tree from diffusers. The rebuilt tree has the
same paths, class names (alias tables key on them), nn.Linear leaves and shapes: all the planner reads
(tools/skeleton.py rebuilds `inspect`'s the same way)."""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from ..tools.skeleton import META_DTYPES, meta_module
from .reference import facets

log = logging.getLogger("loraweave")
FOLDER = Path(__file__).resolve().parent / "skeletons"
FORMAT = 1


def plain(value):
    """`value` as JSON reads it back (tuples become lists), for comparing configs."""
    return json.loads(json.dumps(value, default=list))


def _own(module: torch.nn.Module) -> dict:
    node: dict = {"c": type(module).__name__}
    params = {
        n: [list(p.shape), str(p.dtype).removeprefix("torch.")]
        for n, p in module._parameters.items()
        if p is not None
    }
    buffers = {
        n: [list(b.shape), str(b.dtype).removeprefix("torch.")]
        for n, b in module._buffers.items()
        if b is not None and n not in module._non_persistent_buffers_set
    }
    if params:
        node["p"] = params
    if buffers:
        node["b"] = buffers
    return node


def encode(module: torch.nn.Module) -> dict:
    """The nested description of `module` (see the module docstring)."""
    node = _own(module)
    children = dict(module.named_children())
    if not children:
        return node
    encoded = {name: encode(child) for name, child in children.items()}
    numbered = list(encoded) == [str(i) for i in range(len(encoded))]
    first = next(iter(encoded.values()))
    if numbered and len(encoded) > 1 and all(e == first for e in encoded.values()):
        node["n"], node["t"] = len(encoded), first
    else:
        node["m"] = encoded
    return node


def record(arch: str) -> dict | None:
    """The description of `arch`'s reference tree at its catalog config, built from diffusers now (what
    scripts/comfy_skeletons.py writes); None without a catalog entry or the diffusers class."""
    import diffusers

    from ..arch.catalog import CATALOG

    entry = CATALOG.get(arch)
    if entry is None:
        return None
    cls = getattr(diffusers, entry.cls, None)
    if cls is None:
        return None
    with torch.device("meta"):
        tree = cls.from_config(entry.config)
    config = {k: v for k, v in plain(dict(tree.config)).items() if not k.startswith("_")}
    return {"format": FORMAT, "arch": arch, "cls": entry.cls, "config": config, "tree": encode(tree)}


Widths = dict[str, tuple[int, int]]  # {module path: (axis, size)} of a weight resized from the stored one


def _resized(params: dict, axis: int, size: int) -> dict:
    """A Linear's stored parameters, the weight's `axis` set to `size` (the bias follows an output axis)."""
    out = {name: [list(shape), dtype] for name, (shape, dtype) in params.items()}
    out["weight"][0][axis] = size
    if axis == 0 and "bias" in out:
        out["bias"][0][0] = size
    return out


def _build(node: dict, path: str, depths: dict[str, int], widths: Widths | None = None) -> torch.nn.Module:
    widths = widths or {}
    params = _resized(node["p"], *widths[path]) if path in widths else node.get("p", {})
    module = meta_module(node["c"], params)
    for name, (shape, dtype) in node.get("b", {}).items():
        module.register_buffer(
            name, torch.empty(shape, device="meta", dtype=META_DTYPES.get(dtype, torch.float32))
        )
    if "t" in node:
        children = {str(i): node["t"] for i in range(depths.get(path, node["n"]))}
    else:
        children = node.get("m", {})
    for name, child in children.items():
        module.add_module(name, _build(child, f"{path}.{name}" if path else name, depths, widths))
    return module


def rebuild(
    data: dict, depths: dict[str, int] | None = None, config: dict | None = None, widths: Widths | None = None
) -> torch.nn.Module:
    """The tree of a description (`data["tree"]`), block chains at `depths` ({chain path: count}), weights
    resized by `widths`."""
    root = _build(data["tree"], "", depths or {}, widths)
    # torch types a Module's attributes as Tensor | Module; diffusers reads a plain `config` here
    fields = config if config is not None else data["config"]
    root.config = SimpleNamespace(**fields)  # type: ignore[assignment]
    return root


@functools.cache
def description(arch: str) -> dict | None:
    path = FOLDER / f"{arch}.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return data if data.get("format") == FORMAT else None


def fitted_depths(arch: str, data: dict, config: dict) -> dict[str, int] | None:
    """{chain path: count} when `config` equals the stored config but for the architecture's depth keys; None
    when any other entry differs (or a depth is not a non-negative int, or its chain is not stored as one)."""
    stored, depth_keys = data["config"], facets(arch).depths
    depths: dict[str, int] = {}
    for key, value in plain(config).items():
        if key in facets(arch).widths:
            continue  # fitted_widths
        if key in depth_keys and value != stored.get(key):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                return None
            for chain in depth_keys[key]:
                if not _is_chain(data["tree"], chain):
                    return None
                depths[chain] = value
        elif key not in stored or stored[key] != value:
            return None
    return depths


def _is_chain(node: dict, path: str) -> bool:
    found = _node(node, path)
    return found is not None and "t" in found


def packaged_tree(arch: str, cls: str, config: dict) -> torch.nn.Module | None:
    """`cls` at `config` from the skeleton that `arch`'s ComfyUI facets ship; None when none fits."""
    name = facets(arch).skeleton
    data = description(name) if name is not None else None
    if data is None or data["cls"] != cls:
        return None
    depths, widths = fitted_depths(arch, data, config), fitted_widths(arch, data, config)
    if depths is None or widths is None:
        return None
    return rebuild(data, depths, {**data["config"], **plain(config)}, widths)


def fitted_widths(arch: str, data: dict, config: dict) -> Widths | None:
    """{module path: (axis, size)} for the width keys of `config` that differ from the stored ones (a key set
    to None takes its default key's value, as diffusers reads it); None when a size is not a positive int or
    the stored tree lacks that Linear."""
    stored, merged = data["config"], {**data["config"], **plain(config)}
    widths: Widths = {}
    for key, (path, axis, default) in facets(arch).widths.items():
        want = merged.get(key) if merged.get(key) is not None else merged.get(default)
        have = stored.get(key) if stored.get(key) is not None else stored.get(default)
        if want == have:
            continue
        node = _node(data["tree"], path)
        if (
            not isinstance(want, int)
            or isinstance(want, bool)
            or want < 1
            or node is None
            or node["c"] != "Linear"
        ):
            return None
        widths[path] = (axis, want)
    return widths


def _node(node: dict, path: str) -> dict | None:
    for name in path.split("."):
        node = node.get("m", {}).get(name)
        if node is None:
            return None
    return node
