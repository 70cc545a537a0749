"""A handle's switching cache (resolve/cache.py ResolveCache) keeps sources by the one file key
(io.file_cache.file_identity) and the one LRU bounded by count and bytes: a file rewritten with its size and
mtime restored is read and planned again, a directory is never kept, and dropping a source drops its plans."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from torch import nn

from loraweave.resolve.cache import ResolveCache, source_key
from loraweave.resolve.target import as_components


def _model() -> nn.Module:
    model = nn.Module()
    model.fc = nn.Linear(8, 6)
    return model


def _file(path, value: float = 1.0):
    save_file(
        {"fc.lora_down.weight": torch.full((2, 8), value), "fc.lora_up.weight": torch.ones(6, 2)}, str(path)
    )
    return path


def _plan_of(cache: ResolveCache, path):
    adapter = cache.load(path)
    return adapter, cache.resolve([(adapter, 1.0)], [path])


def test_a_file_rewritten_with_size_and_mtime_restored_is_read_again(tmp_path):
    cache = ResolveCache(as_components(_model()))
    path = _file(tmp_path / "a.safetensors")
    first, _ = _plan_of(cache, path)
    assert cache.load(path) is first  # kept
    stamp = path.stat()
    _file(path, 2.0)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_size == stamp.st_size and path.stat().st_mtime_ns == stamp.st_mtime_ns
    again, plan = _plan_of(cache, path)
    assert again is not first
    assert torch.equal(again.tensor("fc.lora_down.weight"), torch.full((2, 8), 2.0))
    assert plan.planned and plan.planned[0].adapter is again


def test_a_directory_is_never_kept(tmp_path):
    folder = tmp_path / "peft"
    folder.mkdir()
    assert source_key(folder) is None and source_key(tmp_path / "missing.safetensors") is None
    assert source_key({"x": 1})[0] == "object"


def test_the_byte_bound_drops_the_oldest_source_and_its_plans(tmp_path, monkeypatch):
    import loraweave.resolve.cache as resolve_cache

    calls = []
    real = resolve_cache.resolve
    monkeypatch.setattr(resolve_cache, "resolve", lambda *a, **k: calls.append(1) or real(*a, **k))
    a, b = _file(tmp_path / "a.safetensors"), _file(tmp_path / "b.safetensors")
    cache = ResolveCache(as_components(_model()), limit=16, max_bytes=a.stat().st_size)  # one file fits
    first_a, _ = _plan_of(cache, a)
    _plan_of(cache, a)
    assert len(calls) == 1  # kept: loaded and planned once
    first_b, _ = _plan_of(cache, b)
    assert cache.load(b) is first_b and len(calls) == 2
    again_a, _ = _plan_of(cache, a)  # dropped by the byte bound: read and planned again
    assert again_a is not first_a and len(calls) == 3
