"""One journal per handle: every change loraweave made to a model, as installed objects with `undo()`.

Entries: merged layers (MergedModule), runtime paths (RuntimePath), quantized side-channel/requantize writes
(QuantWrite) and grown inputs (GrownInput). An entry is recorded BEFORE the change it stands for is made, so a
failure (or an interrupt) at any point finds it; undo runs in reverse order of recording (a grown input is
put back after the merge into it is undone). apply, switch, set_strength and remove all go through here.

`model_lock(roots)` serializes changes to one model: a thread changing a model waits for another thread's
change to finish (per component root, taken in a fixed order, re-entrant for the same thread)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Protocol, TypeVar

log = logging.getLogger("loraweave")


T = TypeVar("T")


class Installed(Protocol):
    # read-only here: each kind of entry keeps its own (mutable, narrower) attributes
    @property
    def module(self) -> object: ...  # the module the change is on
    @property
    def adapters(self) -> set[str] | frozenset[str]: ...  # adapters whose strength the entry follows

    def undo(self) -> None: ...


E = TypeVar("E", bound=Installed)


class Journal:
    def __init__(self) -> None:
        self.entries: list[Installed] = []

    def record(self, entry: Installed) -> Installed:
        """Record `entry` before the change it stands for is made (undo must cope with a change not yet
        made)."""
        self.entries.append(entry)
        return entry

    def of(self, cls: type[T]) -> list[T]:
        return [e for e in self.entries if isinstance(e, cls)]

    def by_module(self, cls: type[E]) -> dict[int, E]:
        return {id(e.module): e for e in self.entries if isinstance(e, cls)}

    def buried(self) -> list[Installed]:
        """Entries another handle merged over since (only the newest merge on a layer undoes exactly)."""
        return [e for e in self.entries if hasattr(e, "is_top") and not e.is_top()]

    def undo(self, entries: Iterable[Installed] | None = None) -> None:
        """Undo `entries` (default: all) newest first and forget them. Every undo runs even if one raises;
        the first error is raised at the end."""
        chosen = list(self.entries if entries is None else entries)
        ids = {id(e) for e in chosen}
        first: BaseException | None = None
        for entry in reversed([e for e in self.entries if id(e) in ids]):
            try:
                entry.undo()
            except BaseException as exc:  # keep undoing the rest: a half-undone model is the worst outcome
                log.error("loraweave undo failed entry=%s error=%r", type(entry).__name__, exc)
                first = first or exc
        self.entries = [e for e in self.entries if id(e) not in ids]
        if first is not None:
            raise first

    def forget(self, entries: Iterable[Installed]) -> None:
        ids = {id(e) for e in entries}
        self.entries = [e for e in self.entries if id(e) not in ids]

    @contextmanager
    def transaction(self) -> Iterator[Journal]:
        """Changes made inside are undone if anything raises (the journal is left as it was before)."""
        start = len(self.entries)
        try:
            yield self
        except BaseException:
            added = self.entries[start:]
            with suppress(BaseException):
                self.undo(added)
            log.warning("loraweave change failed midway; model restored to its state before the call")
            raise


_LOCKS: weakref.WeakKeyDictionary[object, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock_for(root: object) -> threading.RLock:
    with _LOCKS_GUARD:
        lock = _LOCKS.get(root)
        if lock is None:
            lock = _LOCKS[root] = threading.RLock()
        return lock


@contextmanager
def model_lock(roots: Iterable[object]) -> Iterator[None]:
    """Hold every component root's lock (sorted by id: two calls never wait on each other in a cycle)."""
    locks = [_lock_for(r) for r in sorted(set(roots), key=id)]
    taken = []
    try:
        for lock in locks:
            lock.acquire()
            taken.append(lock)
        yield
    finally:
        for lock in reversed(taken):
            lock.release()
