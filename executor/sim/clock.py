"""``SimClock``: simulated milliseconds that only move forward when told."""

from __future__ import annotations


class SimClock:
    """The replay's notion of now. Nothing sleeps: time jumps to the next event."""

    __slots__ = ("now_ms",)

    def __init__(self, start_ms: float = 0.0) -> None:
        self.now_ms = float(start_ms)

    def advance_to(self, ts_ms: float) -> float:
        """Move to ``ts_ms`` if it is later than now; return now. Earlier times leave the
        clock where it is (events may share a timestamp or arrive slightly out of order)."""
        if ts_ms > self.now_ms:
            self.now_ms = float(ts_ms)
        return self.now_ms

    def advance_by(self, delta_ms: float) -> float:
        if delta_ms < 0:
            raise ValueError(f"delta_ms must be >= 0, got {delta_ms}")
        self.now_ms += delta_ms
        return self.now_ms
