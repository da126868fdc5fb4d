"""Wall-clock bandwidth limits for the real executor (the simulated side has its own
timing model in ``executor.sim.timing``).

- ``Pacer``: emulates a link of fixed bandwidth (the remote tier's network): each
  transfer gets the next slot on a FIFO fluid queue and is held until its slot ends.
- ``TokenBucket``: a budget (bytes/s with a burst) that prefetch traffic into a tier
  may take; a transfer that would wait longer than allowed is refused, not queued,
  because a late prefetch is worthless.
"""

from __future__ import annotations

import threading
import time


class Pacer:
    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._free_s = 0.0

    def slot_end(self, size_bytes: int) -> float:
        """Book ``size_bytes`` on the link; return the monotonic time its transfer ends."""
        with self._lock:
            start = max(time.monotonic(), self._free_s)
            self._free_s = start + size_bytes / self.bytes_per_s
            return self._free_s

    @staticmethod
    def wait_until(end_s: float) -> None:
        delay = end_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class TokenBucket:
    def __init__(self, bytes_per_s: float, burst_bytes: int) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        if burst_bytes < 0:
            raise ValueError(f"burst_bytes must be >= 0, got {burst_bytes}")
        self.bytes_per_s = bytes_per_s
        self.burst_bytes = burst_bytes
        self._lock = threading.Lock()
        self._tokens = float(burst_bytes)
        self._last_s = time.monotonic()

    def reserve(self, size_bytes: int, max_wait_s: float) -> float | None:
        """Debit ``size_bytes``; return how long to wait before sending, or None (and
        debit nothing) when that wait would exceed ``max_wait_s``."""
        with self._lock:
            now = time.monotonic()
            self._tokens = min(
                float(self.burst_bytes), self._tokens + (now - self._last_s) * self.bytes_per_s
            )
            self._last_s = now
            missing = size_bytes - self._tokens
            wait_s = max(0.0, missing / self.bytes_per_s)
            if wait_s > max_wait_s:
                return None
            self._tokens -= size_bytes
            return wait_s
