"""Full-size architecture skeletons from a small on-disk description, so `inspect` does not import diffusers.

The first request builds the real model on `meta` (arch.catalog) and records, per component, every module's
path, class name and own parameter shapes/dtypes (named_modules order). Later requests rebuild a module tree
with the same paths, class names, Linear layers and parameter shapes, which is all the planner looks at (alias
tables key on class names, cloneofsimo enumeration on order and nn.Linear). The cache key holds the loraweave,
diffusers and transformers versions and the catalog entry, so a library upgrade rebuilds it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import torch

from ..arch.catalog import CATALOG, build_meta, canonical

log = logging.getLogger("loraweave")
CACHE_ENV = "LORAWEAVE_CACHE"  # folder for skeletons; "0" disables the cache
META_DTYPES = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def cache_dir() -> Path | None:
    value = os.environ.get(CACHE_ENV)
    if value == "0":
        return None
    return Path(value) if value else Path.home() / ".cache" / "loraweave" / "skeletons"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def _cache_file(name: str) -> Path | None:
    folder = cache_dir()
    if folder is None:
        return None
    from .. import __version__

    entry = CATALOG[name]
    key = json.dumps(
        [
            __version__,
            _version("diffusers"),
            _version("transformers"),
            entry.cls,
            entry.config,
            entry.text_encoders,
            entry.components,
        ],
        sort_keys=True,
        default=str,
    )
    return folder / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def describe(module: torch.nn.Module) -> dict:
    config = getattr(module, "config", None)
    plain = (
        {k: v for k, v in dict(config).items() if isinstance(v, (str, int, float, bool, type(None)))}
        if config is not None and (isinstance(config, dict) or hasattr(config, "items"))
        else {}
    )
    mods = []
    for path, mod in module.named_modules():
        params = {
            n: [list(p.shape), str(p.dtype).removeprefix("torch.")]
            for n, p in mod.named_parameters(recurse=False)
        }
        mods.append([path, type(mod).__name__, params])
    return {"config": plain, "modules": mods}


class _Node(torch.nn.Module):
    """Numbered children iterate like a ModuleList (the UNet name mapping walks down_blocks, resnets, ...)."""

    def __iter__(self):
        return iter(
            v for _, v in sorted(self._modules.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1)
        )

    def __len__(self) -> int:
        return len(self._modules)


_TYPES: dict[str, type] = {}


def _meta(shape, dtype: str, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(
        torch.empty(shape, device="meta", dtype=META_DTYPES.get(dtype, torch.float32)),
        requires_grad=requires_grad,
    )


def _linear(params: dict) -> torch.nn.Linear:
    """A real nn.Linear on meta without its constructor: reset_parameters' init kernels on meta tensors were
    half of a cached rebuild (and their first call pays torch's lazy meta-kernel set-up)."""
    lin = torch.nn.Linear.__new__(torch.nn.Linear)
    torch.nn.Module.__init__(lin)
    lin.out_features, lin.in_features = params["weight"][0]
    shape, dtype = params["weight"]
    lin.weight = _meta(shape, dtype, requires_grad=True)  # what nn.Linear(..., device="meta") holds
    bias = None
    if "bias" in params:
        bias_shape, bias_dtype = params["bias"]
        bias = _meta(bias_shape, bias_dtype, requires_grad=True)
    lin.register_parameter("bias", bias)
    return lin


def meta_module(cls_name: str, params: dict) -> torch.nn.Module:
    if cls_name == "Linear" and "weight" in params and len(params["weight"][0]) == 2:
        return _linear(params)
    if (
        cls_name not in _TYPES
    ):  # same class name as the real module: alias tables and positional rules key on it
        _TYPES[cls_name] = type(cls_name, (_Node,), {"__module__": __name__})
    mod = _TYPES[cls_name]()
    for pname, (shape, dtype) in params.items():
        mod.register_parameter(pname, _meta(shape, dtype, requires_grad=False))
    return mod


def rebuild(desc: dict) -> torch.nn.Module:
    root: torch.nn.Module | None = None
    by_path: dict[str, torch.nn.Module] = {}
    for path, cls_name, params in desc["modules"]:
        mod = meta_module(cls_name, params)
        by_path[path] = mod
        if path == "":
            root = mod
            continue
        parent, _, child = path.rpartition(".")
        by_path[parent].add_module(child, mod)
    assert root is not None  # a description lists its root module (path "")
    # torch types a Module's attributes as Tensor | Module; diffusers reads a plain `config` here
    root.config = SimpleNamespace(**desc.get("config", {}))  # type: ignore[assignment]
    return root


_REUSE: dict | None = (
    None  # (name, text_encoders) -> modules, and id(modules) -> alias tables, inside reuse()
)


@contextlib.contextmanager
def reuse():
    """Inside this block `skeleton()` hands back the same modules per architecture and `alias_tables()` their
    tables, built once: one process inspecting a folder pays for each architecture once. Callers only read
    them (meta modules, planning only)."""
    global _REUSE
    outer = _REUSE
    _REUSE = outer if outer is not None else {}
    try:
        yield
    finally:
        _REUSE = outer


def alias_tables(modules: dict[str, torch.nn.Module]):
    """Alias tables of skeleton `modules`, built once inside `reuse()`; None outside it (the planner
    builds)."""
    if _REUSE is None:
        return None
    from ..arch.aliases import AliasTable

    held = _REUSE.get(id(modules))
    if held is None or held[0] is not modules:
        held = (modules, {c: AliasTable(m) for c, m in modules.items()})
        _REUSE[id(modules)] = held
    return held[1]


def skeleton(name: str, text_encoders: bool = True) -> dict[str, torch.nn.Module]:
    """Like `arch.catalog.build_meta`, from the cached description when there is one."""
    name = canonical(name)
    if _REUSE is not None:
        if (name, text_encoders) not in _REUSE:
            _REUSE[(name, text_encoders)] = _skeleton(name, text_encoders)
        return _REUSE[(name, text_encoders)]
    return _skeleton(name, text_encoders)


def _skeleton(name: str, text_encoders: bool) -> dict[str, torch.nn.Module]:
    t0 = time.perf_counter()
    path = _cache_file(name)
    if path is not None and path.exists():
        try:
            data = json.loads(path.read_text())
            wanted = [c for c in data if text_encoders or c not in CATALOG[name].text_encoders]
            out = {c: rebuild(data[c]) for c in wanted}
            log.info("skeleton arch=%s source=cache seconds=%.3f", name, time.perf_counter() - t0)
            return out
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # a damaged cache: rebuild it below
            log.warning("skeleton arch=%s cache=%s unreadable=%s", name, path, exc)
    modules = build_meta(name, text_encoders=True)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({c: describe(m) for c, m in modules.items()}))
            os.replace(tmp, path)
        except OSError as exc:  # a read-only home only costs speed
            log.info("skeleton arch=%s cache_write_failed=%s", name, exc)
    if not text_encoders:
        modules = {c: m for c, m in modules.items() if c not in CATALOG[name].text_encoders}
    log.info("skeleton arch=%s source=diffusers seconds=%.3f", name, time.perf_counter() - t0)
    return modules
