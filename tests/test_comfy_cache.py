"""The ComfyUI pack's parse cache (comfy/api.py `ADAPTERS`, an io.file_cache.FileCache): files are read whole
into memory, so the files kept for a re-queue are bounded by count and by bytes, least recently used first,
and the newest file is always kept (a strength change on one large LoRA re-reads nothing, as core's
LoraLoader keeps its file). A file is kept by its identity: one rewritten, or rewritten while it was read, is
read again."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import save_file

from loraweave.comfy import api
from loraweave.io.file_cache import BYTES_KEPT, FileCache, file_identity


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
    """A fresh loader cache, bounded as `cache.bound(count, bytes)` sets (default: the pack's bounds)."""
    monkeypatch.setattr(api, "ADAPTERS", FileCache(api.ADAPTERS_KEPT, BYTES_KEPT))
    monkeypatch.bound = lambda count, max_bytes: monkeypatch.setattr(
        api, "ADAPTERS", FileCache(count, max_bytes)
    )
    return monkeypatch


def _kept(path) -> bool:
    return api.ADAPTERS.holds(path)


def test_older_files_are_dropped_beyond_the_byte_bound(cache, tmp_path):
    a, b, c = (_file(tmp_path, n, 64) for n in "abc")
    size = a.stat().st_size
    cache.bound(api.ADAPTERS_KEPT, 2 * size)  # two files fit
    first_a = api.read_lora(a)
    api.read_lora(b)
    assert api.read_lora(a) is first_a  # a re-queue re-reads nothing (and makes a the most recent)
    api.read_lora(c)  # three files exceed the bound: b, the least recently used, goes
    assert [_kept(p) for p in (a, b, c)] == [True, False, True]
    assert api.read_lora(a) is first_a


def test_the_newest_file_is_kept_however_large(cache, tmp_path):
    a, big = _file(tmp_path, "a", 8), _file(tmp_path, "big", 4096)
    cache.bound(api.ADAPTERS_KEPT, big.stat().st_size - 1)
    api.read_lora(a)
    first = api.read_lora(big)
    assert [_kept(a), _kept(big)] == [False, True]
    assert api.read_lora(big) is first


def test_count_bound(cache, tmp_path):
    cache.bound(2, BYTES_KEPT)
    paths = [_file(tmp_path, n, 8) for n in "abc"]
    for p in paths:
        api.read_lora(p)
    assert [_kept(p) for p in paths] == [False, True, True]


def test_a_rewritten_file_is_read_again_even_with_size_and_mtime_restored(cache, tmp_path):
    path = _file(tmp_path, "a", 8)
    first = api.read_lora(path)
    stamp = path.stat()
    save_file(  # same shapes, same size; mtime set back below: only inode or ctime tell
        {
            "lora_unet_a.lora_down.weight": torch.full((4, 8), 2.0),
            "lora_unet_a.lora_up.weight": torch.ones(8, 4),
        },
        str(path),
    )
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_size == stamp.st_size and path.stat().st_mtime_ns == stamp.st_mtime_ns
    again = api.read_lora(path)
    assert again is not first and again is api.read_lora(path)
    assert torch.equal(again.tensor("lora_unet_a.lora_down.weight"), torch.full((4, 8), 2.0))


def test_a_file_changed_while_read_is_returned_not_kept(tmp_path):
    path = _file(tmp_path, "a", 8)
    files = FileCache(4)

    def touching_reader(p):
        os.utime(p, ns=(1, 1))  # the file's identity moves while it is read
        return "first"

    value = files.read(path, touching_reader)
    assert value == "first" and len(files.kept) == 0  # nothing kept under the identity it had
    assert files.read(path, lambda p: "second") == "second" and files.holds(path)


def test_a_directory_is_never_kept(tmp_path):
    folder = tmp_path / "peft"
    folder.mkdir()
    files, reads = FileCache(4), []
    assert file_identity(folder) is None and file_identity(tmp_path / "missing") is None
    for _ in range(2):
        files.read(folder, lambda p: reads.append(p) or len(reads))
    assert len(reads) == 2 and len(files.kept) == 0
