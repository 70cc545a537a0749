"""The ComfyUI pack's parse cache (comfy/api.py): files are read whole into memory, so the files kept for a
re-queue are bounded by count and by bytes, least recently used first, and the newest file is always kept (a
strength change on one large LoRA re-reads nothing, as core's LoraLoader keeps its file)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from safetensors.torch import save_file

from loraweave.comfy import api


def _file(folder, name: str, rows: int):
    path = folder / f"{name}.safetensors"
    save_file(
        {
            "lora_unet_a.lora_down.weight": torch.ones(4, 8),
            "lora_unet_a.lora_up.weight": torch.ones(rows, 4),
        },
        str(path),
    )
    return path


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setattr(api, "_parsed", OrderedDict())
    return monkeypatch


def _kept(path) -> bool:
    key = api._file_identity(path)
    return key in api._parsed


def test_older_files_are_dropped_beyond_the_byte_bound(cache, tmp_path):
    a, b, c = (_file(tmp_path, n, 64) for n in "abc")
    size = a.stat().st_size
    cache.setattr(api, "ADAPTER_BYTES_KEPT", 2 * size)  # two files fit
    first_a = api._cached_file(a)
    api._cached_file(b)
    assert api._cached_file(a) is first_a  # a re-queue re-reads nothing (and makes a the most recent)
    api._cached_file(c)  # three files exceed the bound: b, the least recently used, goes
    assert [_kept(p) for p in (a, b, c)] == [True, False, True]
    assert api._cached_file(a) is first_a


def test_the_newest_file_is_kept_however_large(cache, tmp_path):
    a, big = _file(tmp_path, "a", 8), _file(tmp_path, "big", 4096)
    cache.setattr(api, "ADAPTER_BYTES_KEPT", big.stat().st_size - 1)
    api._cached_file(a)
    first = api._cached_file(big)
    assert [_kept(a), _kept(big)] == [False, True]
    assert api._cached_file(big) is first


def test_count_bound(cache, tmp_path):
    cache.setattr(api, "ADAPTERS_KEPT", 2)
    paths = [_file(tmp_path, n, 8) for n in "abc"]
    for p in paths:
        api._cached_file(p)
    assert [_kept(p) for p in paths] == [False, True, True]
