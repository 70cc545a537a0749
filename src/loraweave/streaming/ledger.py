"""Device byte accounting: every device allocation the streamer makes is booked here and checked against the
budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import BudgetExceeded


@dataclass
class Ledger:
    limit: int  # budget minus margin: what the streamer itself may hold
    held: dict[str, int] = field(default_factory=dict)
    current: int = 0
    peak: int = 0
    trace: list[tuple[str, int]] | None = None  # (event, bytes held after it) when tracing is on

    def book(self, tag: str, nbytes: int) -> None:
        """Record `nbytes` now held under `tag` (replacing what the tag held before)."""
        after = self.current - self.held.get(tag, 0) + nbytes
        if after > self.limit:
            raise BudgetExceeded(
                f"streaming would hold {after} B on the device, over its limit {self.limit} B ({tag})"
            )
        self.held[tag] = nbytes
        self.current = after
        self.peak = max(self.peak, after)
        if self.trace is not None:
            self.trace.append((f"+{tag}", after))

    def free(self, tag: str) -> None:
        nbytes = self.held.pop(tag, 0)
        self.current -= nbytes
        if self.trace is not None and nbytes:
            self.trace.append((f"-{tag}", self.current))

    def free_all(self) -> None:
        for tag in list(self.held):
            self.free(tag)

    def note(self, event: str) -> None:
        """A step boundary in the trace (e.g. a block's forward), with the bytes held there."""
        if self.trace is not None:
            self.trace.append((event, self.current))
