"""What was read from a file, kept by what the file is: one key (`file_identity`) and one LRU bounded by count
and by bytes. Every cache of parsed adapters (the ComfyUI loader's, a handle's switching cache) and every
"has this file changed" fingerprint (ComfyUI's node re-run check) uses this key, so none of them serves data
of a file that was rewritten, whatever tool rewrote it."""

from __future__ import annotations

import logging
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, NamedTuple, TypeVar

log = logging.getLogger("loraweave")
K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
# Files whole in memory are the largest thing kept: the older ones are also bounded by bytes (the newest is
# kept whatever its size: a strength change on one large LoRA re-reads nothing, as core's LoraLoader keeps
# its file).
BYTES_KEPT = 2 * 2**30


class FileIdentity(NamedTuple):
    """What changes whenever the file's bytes may have: inode, size, mtime and ctime (ctime no tool can set
    back, so a rewrite that restores size and mtime is still seen)."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def file_identity(path: str | os.PathLike) -> FileIdentity | None:
    """The identity of the regular file at `path`; None for anything else (a PEFT directory: its files change
    under an unchanged folder) or a path that cannot be read (the reader names it in its own error)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return FileIdentity(
        os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns
    )


class BoundedCache(Generic[K, V]):
    """An LRU bounded by `count` entries and by `max_bytes` (each entry's size as given); the newest entry is
    always kept. What belongs to an entry lives in its value, so dropping it drops them (no drop callback:
    one back to the owner would make a reference cycle holding every kept tensor)."""

    def __init__(self, count: int, max_bytes: int = BYTES_KEPT) -> None:
        self.count, self.max_bytes = count, max_bytes
        self.entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.held = 0  # the sizes of the kept entries, kept as a running total

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: K) -> V | None:
        """The value kept under `key` (now the most recent), or None."""
        hit = self.entries.get(key)
        if hit is None:
            return None
        self.entries.move_to_end(key)
        return hit[0]

    def put(self, key: K, value: V, size: int = 0) -> None:
        old = self.entries.get(key)
        self.held += size - (old[1] if old is not None else 0)
        self.entries[key] = (value, size)
        self.entries.move_to_end(key)
        self._bound()

    def held_bytes(self) -> int:
        return self.held

    def _bound(self) -> None:
        """Drop the least recently used entries beyond `count`, or beyond `max_bytes`, never the newest."""
        while len(self.entries) > self.count or (
            len(self.entries) > 1 and self.held_bytes() > self.max_bytes
        ):
            key, (_, size) = self.entries.popitem(last=False)
            self.held -= size
            log.debug("file_cache=drop key=%s bytes=%d", key, size)


class FileCache(Generic[V]):
    """Values read from regular files, kept by `file_identity` and bounded by count and file bytes. A file
    whose identity changed is read again; a value whose file changed while it was read is returned, not kept;
    what is not one regular file is read every time."""

    def __init__(self, count: int, max_bytes: int = BYTES_KEPT, weigh_files: bool = True) -> None:
        self.kept: BoundedCache[FileIdentity, V] = BoundedCache(count, max_bytes)
        self.weigh_files = weigh_files  # False: values small beside their files (a header's answer)

    def read(self, path: str | os.PathLike, reader: Callable[[str | os.PathLike], V]) -> V:
        key = file_identity(path)
        if key is not None and key in self.kept:  # `in`, not get: a kept answer may be None
            return self.kept.get(key)  # type: ignore[return-value]
        value = reader(path)
        if key is not None and file_identity(path) == key:  # unchanged while it was read
            self.kept.put(key, value, key.size if self.weigh_files else 0)
        return value

    def holds(self, path: str | os.PathLike) -> bool:
        """Whether the file as it is now is kept."""
        key = file_identity(path)
        return key is not None and key in self.kept
