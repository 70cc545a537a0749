"""Ctrl-C held back over a short stretch of writes that have no undo (undo="none" at commit): all or
nothing."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def interrupts_held() -> Iterator[None]:
    """Within: SIGINT is noted, not delivered; on exit the previous handler is back and receives it once.
    Off the main thread (where Python takes no signal handlers) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
        if caught:
            signal.raise_signal(signal.SIGINT)
